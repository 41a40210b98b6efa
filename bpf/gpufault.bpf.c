// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * gpufault's generic fault engine: one entry uprobe and one return
 * uretprobe program, parameterised per attachment by the BPF cookie
 * (spec index << 32 | function index) and the "specs" config map.
 *
 * Each program exists in variants: the plain one never writes registers
 * or user memory and loads everywhere (fail, stall and corrupt are then
 * finished by the ptrace copilot); "_regs" writes pt_regs directly, where
 * the verifier lets uprobe programs do that; "_wu" writes user memory with
 * bpf_probe_write_user, where kernel lockdown allows it. The controller
 * autoloads one entry and one return program after trial loads.
 */
#include <stdbool.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "gpufault.h"

/* x86-64 struct pt_regs, the uprobe context. Same order as GF_NREGS. */
struct gf_regs {
	__u64 r15, r14, r13, r12, bp, bx, r11, r10, r9, r8;
	__u64 ax, cx, dx, si, di, orig_ax, ip, cs, flags, sp, ss;
};

/* Load-time settings (the controller fills .rodata before load). */
const volatile __u32 copilot_signo = 23;	/* SIGURG: ignored by default */
const volatile __u64 events_wake_bytes = 256 * 1024;

/* Fire counter of the run: fault_seq of the next fire is this + 1. */
__u64 fault_seq_ctr = 0;

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, GF_MAX_SPECS);
	__type(key, __u32);
	__type(value, struct gf_spec);
} specs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, GF_MAX_SPECS);
	__type(key, __u32);
	__type(value, struct gf_counters);
} counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, GF_STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

struct inflight_key {
	__u32 tid;
	__u32 cookie_lo;	/* function index: one entry per (thread, func) */
	__u32 spec;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct inflight_key);
	__type(value, struct gf_inflight);
} inflight SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct gf_pending);
} pending SEC(".maps");

/* tid -> fault_seq: link this thread's next failing return to the fault. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u64);
} follow SEC(".maps");

/* tgid -> 1: processes whose signals and exit we record. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
} watched SEC(".maps");

/* Per-CPU scratch for a gf_pending: too big for the 512-byte BPF stack. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gf_pending);
} scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 8 << 20);
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} fires SEC(".maps");

static __always_inline void stat_add(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &idx);

	if (v)
		__sync_fetch_and_add(v, 1);
}

/* args[i - 1] with constant offsets only (keeps the verifier simple). */
static __always_inline __u64 arg_at(const __u64 *args, __u32 i)
{
	switch (i) {
	case 1: return args[0];
	case 2: return args[1];
	case 3: return args[2];
	case 4: return args[3];
	case 5: return args[4];
	case 6: return args[5];
	}
	return 0;
}

static __always_inline bool pred_holds(const struct gf_spec *s, const __u64 *args)
{
	__u32 i = s->pred_arg;
	__u64 v;

	if (!i || s->pred_op == GF_PRED_NONE)
		return true;
	if (i > GF_NARGS)
		return false;
	v = arg_at(args, i);
	switch (s->pred_op) {
	case GF_PRED_EQ: return v == s->pred_val;
	case GF_PRED_NE: return v != s->pred_val;
	case GF_PRED_LT: return v < s->pred_val;
	case GF_PRED_GT: return v > s->pred_val;
	case GF_PRED_LE: return v <= s->pred_val;
	case GF_PRED_GE: return v >= s->pred_val;
	case GF_PRED_MASK: return (v & s->pred_val) != 0;
	}
	return false;
}

/* The trigger: does this matching call (number call_seq) fire? */
static __always_inline bool should_fire(const struct gf_spec *s,
					struct gf_counters *c, __u64 call_seq,
					__u64 now)
{
	__u64 n;

	if (s->action == GF_ACT_OBSERVE)
		return false;
	if (s->deadline_ns && now >= s->deadline_ns) {
		__sync_fetch_and_add(&c->expired, 1);
		return false;
	}
	if (s->window_start_ns && now < s->window_start_ns)
		return false;
	if ((s->flags & GF_F_STICKY) && c->sticky) {
		__sync_fetch_and_add(&c->fires, 1);
		return true;
	}
	if (s->nth && call_seq != s->nth)
		return false;
	if (s->every && call_seq % s->every)
		return false;
	if (s->after && call_seq <= s->after)
		return false;
	if (s->prob_ppm && bpf_get_prandom_u32() % 1000000 >= s->prob_ppm)
		return false;
	/* Claim a fire; give it back if that overshoots max (exact count). */
	n = __sync_fetch_and_add(&c->fires, 1);
	if (s->max_fires && n >= s->max_fires) {
		__sync_fetch_and_add(&c->fires, -1);
		return false;
	}
	if (s->flags & GF_F_STICKY)
		c->sticky = 1;
	return true;
}

static __always_inline void read_args(struct gf_regs *r, __u64 *args)
{
	args[0] = r->di;
	args[1] = r->si;
	args[2] = r->dx;
	args[3] = r->cx;
	args[4] = r->r8;
	args[5] = r->r9;
}

static __always_inline void emit_fire(void *ctx, const struct gf_spec *s,
				      __u64 cookie, __u64 call_seq,
				      __u64 seq, __u64 now, __u32 mech)
{
	struct gf_fire_event *e;
	__u64 id = bpf_get_current_pid_tgid();

	e = bpf_ringbuf_reserve(&fires, sizeof(*e), 0);
	if (!e) {
		stat_add(GF_STAT_FIRES_LOST);
		return;
	}
	e->fault_seq = seq;
	e->ts_ns = now;
	e->cookie = cookie;
	e->call_seq = call_seq;
	e->pid = id >> 32;
	e->tid = (__u32)id;
	e->action = s->action;
	e->mech = mech;
	e->retval = s->retval;
	e->flags = s->flags;
	__builtin_memcpy(e->regs, ctx, sizeof(e->regs));
	bpf_get_current_comm(e->comm, sizeof(e->comm));
	e->stack_bytes = 0;
	if (s->flags & GF_F_CAP_STACK)
		e->stack_bytes = bpf_get_stack(ctx, e->stack, sizeof(e->stack),
					       BPF_F_USER_STACK);
	/* Fires are rare and the copilot may be waiting: wake at once. */
	bpf_ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
}

static __always_inline void emit_call(__u32 kind, __u64 cookie, __u64 ts,
				      __u64 lat, __u64 call_seq, __u64 seq,
				      const __u64 *args, __s64 ret)
{
	struct gf_call_event *e;
	__u64 id = bpf_get_current_pid_tgid();
	__u64 flags, avail;

	e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		stat_add(GF_STAT_EVENTS_LOST);
		return;
	}
	e->ts_ns = ts;
	e->latency_ns = lat;
	e->cookie = cookie;
	e->call_seq = call_seq;
	e->fault_seq = seq;
	__builtin_memcpy(e->args, args, sizeof(e->args));
	e->ret = ret;
	e->pid = id >> 32;
	e->tid = (__u32)id;
	e->kind = kind;
	e->flags = 0;
	/*
	 * A wake-up per record costs more than the record: wake the consumer
	 * only when this record makes the backlog cross the threshold (it also
	 * polls on a short timer, which covers a crossing raced by two CPUs).
	 */
	avail = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA);
	flags = avail >= events_wake_bytes &&
		avail < events_wake_bytes + sizeof(*e) + 8 ?
		BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
	bpf_ringbuf_submit(e, flags);
}

/* Hand the rest of a fire to the copilot: state first, then the signal. */
static __always_inline void to_copilot(void *ctx, const struct gf_spec *s,
				       __u64 seq, __u32 tid, __u64 corrupt_addr)
{
	__u32 zero = 0;
	struct gf_pending *p = bpf_map_lookup_elem(&scratch, &zero);

	if (!p)
		return;
	p->fault_seq = seq;
	__builtin_memcpy(p->regs, ctx, sizeof(p->regs));
	p->retval = s->retval;
	p->stall_ns = s->stall_ns;
	p->deadline_ns = s->deadline_ns;
	p->action = s->action;
	p->flags = s->flags;
	p->corrupt_addr = corrupt_addr;
	p->corrupt_mask = s->corrupt_mask;
	p->corrupt_op = s->corrupt_op;
	p->corrupt_len = s->corrupt_len;
	if (bpf_map_update_elem(&pending, &tid, p, BPF_ANY)) {
		stat_add(GF_STAT_PENDING_ERR);
		return;
	}
	if (bpf_send_signal_thread(copilot_signo))
		stat_add(GF_STAT_SIGNAL_ERR);
}

static __always_inline int do_entry(struct gf_regs *ctx, const bool regs_ok)
{
	__u64 cookie = bpf_get_attach_cookie(ctx);
	__u32 si = GF_COOKIE_SPEC(cookie);
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct gf_inflight inf = {};
	struct gf_counters *c;
	struct gf_spec *s;
	__u64 now, call_seq, seq = 0, ra;
	__u32 mech = GF_MECH_BPF;
	bool fire;

	s = bpf_map_lookup_elem(&specs, &si);
	c = bpf_map_lookup_elem(&counters, &si);
	if (!s || !c || !(s->flags & GF_F_ENABLED))
		return 0;
	/* Who: cheap filters first, so armed-not-matching costs little. */
	if (s->tgid && s->tgid != tgid)
		return 0;
	if (s->tid && s->tid != tid)
		return 0;
	read_args(ctx, inf.args);
	if (!pred_holds(s, inf.args))
		return 0;

	call_seq = __sync_fetch_and_add(&c->calls, 1) + 1;
	now = bpf_ktime_get_ns();
	fire = should_fire(s, c, call_seq, now);

	if (fire) {
		seq = __sync_fetch_and_add(&fault_seq_ctr, 1) + 1;
		if ((s->action == GF_ACT_FAIL && !(s->flags & GF_F_AFTER)) ||
		    s->action == GF_ACT_STALL)
			mech = regs_ok && s->action == GF_ACT_FAIL ?
				GF_MECH_REGS : GF_MECH_COPILOT;
		if (s->action == GF_ACT_FAIL && (s->flags & GF_F_AFTER))
			mech = regs_ok ? GF_MECH_REGS : GF_MECH_COPILOT;
		if (s->action == GF_ACT_CORRUPT && (s->flags & GF_F_COPILOT))
			mech = GF_MECH_COPILOT;
		emit_fire(ctx, s, cookie, call_seq, seq, now, mech);

		switch (s->action) {
		case GF_ACT_SIGNAL:
			if (bpf_send_signal_thread(s->signo))
				stat_add(GF_STAT_SIGNAL_ERR);
			break;
		case GF_ACT_STALL:
			to_copilot(ctx, s, seq, tid, 0);
			break;
		case GF_ACT_FAIL:
			if (s->flags & GF_F_AFTER)
				break;	/* done by the return program */
			if (regs_ok) {
				/* Return at once: ip = return address, pop it. */
				if (bpf_probe_read_user(&ra, sizeof(ra),
							(void *)ctx->sp)) {
					stat_add(GF_STAT_CORRUPT_ERR);
					break;
				}
				ctx->ax = s->retval;
				ctx->ip = ra;
				ctx->sp += 8;
			} else {
				to_copilot(ctx, s, seq, tid, 0);
			}
			break;
		}
	}

	if (s->flags & GF_F_RETPROBE) {
		struct inflight_key k = { .tid = tid, .cookie_lo = GF_COOKIE_FUNC(cookie),
					  .spec = si };

		inf.ts_ns = now;
		inf.call_seq = call_seq;
		inf.fault_seq = seq;
		inf.fired = fire;
		if (bpf_map_update_elem(&inflight, &k, &inf, BPF_ANY))
			stat_add(GF_STAT_INFLIGHT_ERR);
	} else if ((s->flags & GF_F_TRACE) || fire) {
		/* No return probe: the entry is all we will see of this call. */
		emit_call(GF_EV_ENTRY, cookie, now, 0, call_seq, seq, inf.args,
			  fire && s->action == GF_ACT_FAIL ? s->retval : 0);
		if (fire)
			bpf_map_update_elem(&follow, &tid, &seq, BPF_ANY);
	}
	return 0;
}

static __always_inline void do_corrupt(void *ctx, const struct gf_spec *s,
				       const struct gf_inflight *inf, __u32 tid,
				       const bool wu_ok)
{
	__u32 i = s->corrupt_arg;
	__u64 old = 0, val;
	void *p;

	if (!i || i > GF_NARGS)
		return;
	p = (void *)(arg_at(inf->args, i) + s->corrupt_off);
	if (!wu_ok) {
		/* Kernel lockdown forbids bpf_probe_write_user: copilot writes. */
		to_copilot(ctx, s, inf->fault_seq, tid, (__u64)p);
		return;
	}
	if (bpf_probe_read_user(&old, sizeof(old), p)) {
		stat_add(GF_STAT_CORRUPT_ERR);
		return;
	}
	switch (s->corrupt_op) {
	case GF_CORRUPT_XOR: val = old ^ s->corrupt_mask; break;
	case GF_CORRUPT_SET: val = s->corrupt_mask; break;
	default: val = 0; break;
	}
	/* Write exactly corrupt_len bytes (little endian low bytes of val). */
	switch (s->corrupt_len) {
	case 1: if (bpf_probe_write_user(p, &val, 1)) goto err; break;
	case 2: if (bpf_probe_write_user(p, &val, 2)) goto err; break;
	case 4: if (bpf_probe_write_user(p, &val, 4)) goto err; break;
	default: if (bpf_probe_write_user(p, &val, 8)) goto err; break;
	}
	return;
err:
	stat_add(GF_STAT_CORRUPT_ERR);
}

static __always_inline int do_return(struct gf_regs *ctx, const bool regs_ok,
				     const bool wu_ok)
{
	__u64 cookie = bpf_get_attach_cookie(ctx);
	__u32 si = GF_COOKIE_SPEC(cookie);
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)id;
	struct inflight_key k = { .tid = tid, .cookie_lo = GF_COOKIE_FUNC(cookie),
				  .spec = si };
	struct gf_inflight *inf;
	struct gf_spec *s;
	__s64 ret = ctx->ax;
	__u64 now, *fseq;

	s = bpf_map_lookup_elem(&specs, &si);
	if (!s)
		return 0;
	inf = bpf_map_lookup_elem(&inflight, &k);
	if (!inf) {
		/* Not a matching call: only the fired thread's next error counts. */
		if ((__u32)ret == 0)
			return 0;
		fseq = bpf_map_lookup_elem(&follow, &tid);
		if (fseq) {
			__u64 args[GF_NARGS] = {};

			emit_call(GF_EV_FOLLOW, cookie, bpf_ktime_get_ns(), 0, 0,
				  *fseq, args, ret);
			bpf_map_delete_elem(&follow, &tid);
		}
		return 0;
	}
	now = bpf_ktime_get_ns();
	if (inf->fired) {
		if (s->action == GF_ACT_FAIL && (s->flags & GF_F_AFTER)) {
			if (regs_ok)
				ctx->ax = s->retval;
			else
				to_copilot(ctx, s, inf->fault_seq, tid, 0);
			ret = s->retval;
		} else if (s->action == GF_ACT_CORRUPT) {
			do_corrupt(ctx, s, inf, tid, wu_ok);
		}
		emit_call(GF_EV_CALL, cookie, inf->ts_ns, now - inf->ts_ns,
			  inf->call_seq, inf->fault_seq, inf->args, ret);
		bpf_map_update_elem(&follow, &tid, &inf->fault_seq, BPF_ANY);
	} else {
		if (s->flags & GF_F_TRACE)
			emit_call(GF_EV_CALL, cookie, inf->ts_ns, now - inf->ts_ns,
				  inf->call_seq, 0, inf->args, ret);
		if ((__u32)ret != 0) {
			fseq = bpf_map_lookup_elem(&follow, &tid);
			if (fseq) {
				emit_call(GF_EV_FOLLOW, cookie, inf->ts_ns,
					  now - inf->ts_ns, inf->call_seq, *fseq,
					  inf->args, ret);
				bpf_map_delete_elem(&follow, &tid);
			}
		}
	}
	bpf_map_delete_elem(&inflight, &k);
	return 0;
}

SEC("uprobe")
int gf_entry(struct gf_regs *ctx)
{
	return do_entry(ctx, false);
}

SEC("uretprobe")
int gf_return(struct gf_regs *ctx)
{
	return do_return(ctx, false, false);
}

SEC("uretprobe")
int gf_return_wu(struct gf_regs *ctx)
{
	return do_return(ctx, false, true);
}

SEC("uprobe")
int gf_entry_regs(struct gf_regs *ctx)
{
	return do_entry(ctx, true);
}

SEC("uretprobe")
int gf_return_regs(struct gf_regs *ctx)
{
	return do_return(ctx, true, false);
}

SEC("uretprobe")
int gf_return_regs_wu(struct gf_regs *ctx)
{
	return do_return(ctx, true, true);
}

/* ---- how watched processes end: signals and exit (no module needed) ---- */

struct trace_event_raw_signal_deliver {
	__u64 common;
	int sig;
	int errno;
	int code;
	unsigned long sa_handler;
	unsigned long sa_flags;
} __attribute__((preserve_access_index));

struct task_struct {
	int exit_code;
} __attribute__((preserve_access_index));

static __always_inline void emit_proc(__u32 kind, int signo, int code)
{
	struct gf_proc_event *e;
	__u64 id = bpf_get_current_pid_tgid();

	e = bpf_ringbuf_reserve(&fires, sizeof(*e), 0);
	if (!e) {
		stat_add(GF_STAT_FIRES_LOST);
		return;
	}
	e->magic = GF_PROC_MAGIC;
	e->ts_ns = bpf_ktime_get_ns();
	e->pid = id >> 32;
	e->tid = (__u32)id;
	e->kind = kind;
	e->signo = signo;
	e->code = code;
	e->pad = 0;
	bpf_get_current_comm(e->comm, sizeof(e->comm));
	bpf_ringbuf_submit(e, BPF_RB_FORCE_WAKEUP);
}

SEC("tracepoint/signal/signal_deliver")
int gf_signal_deliver(struct trace_event_raw_signal_deliver *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	int sig = BPF_CORE_READ(ctx, sig);

	if (!bpf_map_lookup_elem(&watched, &tgid))
		return 0;
	if (sig == (int)copilot_signo)	/* our own hand-off signal */
		return 0;
	emit_proc(GF_PROC_SIGNAL, sig, BPF_CORE_READ(ctx, code));
	return 0;
}

SEC("tracepoint/sched/sched_process_exit")
int gf_process_exit(void *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32;
	struct task_struct *t;

	if ((__u32)id != tgid || !bpf_map_lookup_elem(&watched, &tgid))
		return 0;
	t = (struct task_struct *)bpf_get_current_task();
	emit_proc(GF_PROC_EXIT, 0, BPF_CORE_READ(t, exit_code));
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
