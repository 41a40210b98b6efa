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
/* The gfsig helper's signal (GF_F_SIGNAL specs): the copilot's, unless a run
 * has both (then another one, which the copilot passes on). */
const volatile __u32 helper_signo = 23;
const volatile __u64 events_wake_bytes = 256 * 1024;
/* Pages of user stack copied at a fire of a GF_F_CAP_USTACK spec (0 to
 * GF_USTACK_PAGES): a constant to the verifier, so the record's size is. */
const volatile __u32 ustack_pages = 4;

struct inflight_key {
	__u32 tid;
	__u32 cookie_lo;	/* function index: one entry per (thread, func) */
	__u32 spec;
	__u32 pad;
};

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

/*
 * Per-thread scratch. Why not locals or a per-CPU array: uprobe programs
 * run preemptibly (migrate_disable only), and kernels since 6.13 give a
 * program whose stack reaches 64 bytes a *per-CPU* private stack. Two
 * threads preempting each other on one CPU inside such a program then
 * share one stack, and the kernel oopses (seen on 7.2 under qemu). So the
 * programs keep their own stack below 64 bytes (tests/test_bpf_stack.py
 * checks the JIT image) and park everything else here, per task.
 */
struct gf_task {
	struct gf_inflight inf;	/* this call's entry state */
	struct gf_pending pend;	/* built here, then copied into "pending" */
	struct inflight_key k;
	__u64 cookie;
	__u64 ra;
	__u32 tid;
	__u32 mech;
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct gf_task);
} tasks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 8 << 20);
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} fires SEC(".maps");

/* Stack copies (struct gf_ustack_event): big, so not in "fires", whose
 * room decides whether a fault fires at all. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 8 << 20);
} ustacks SEC(".maps");

static __always_inline void stat_add(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &idx);

	if (v)
		__sync_fetch_and_add(v, 1);
}

static __always_inline void stat_max(__u32 idx, __u64 val)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &idx);

	if (v && val > *v)
		*v = val;	/* racy max: a diagnostic, never a count */
}

/*
 * An events record of `size` bytes was not reserved. 6.18's
 * __bpf_ringbuf_reserve() returns NULL when the record does not fit before
 * the consumer position, when it does not fit before the oldest uncommitted
 * record, or when its rqspinlock gives up. Look at the ring right after and
 * count which: full, or room when looked at (the lock, an uncommitted
 * record, or a consumer that freed room in between: a batch commit frees
 * megabytes at once). A backlog maximum above the ring's size means the
 * kernel read a consumer position that was never true: a torn write by
 * the consumer (pyctl/bpf/ringbuf.py says why it writes in one store).
 * Kept to two helper calls and no locals in memory: a uprobe program whose
 * stack reaches 64 bytes gets a per-CPU private stack on kernels that have
 * them (7.x), which preempting threads share (tests/test_bpf_stack.py);
 * reading pending_pos from the kernel's struct as well cost that.
 */
static __always_inline void events_lost(__u32 size)
{
	__u64 len = (size + 8 + 7) & ~7ULL;	/* header, 8-byte rounding */
	__u64 avail = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA);
	__u64 ring = bpf_ringbuf_query(&events, BPF_RB_RING_SIZE);

	stat_add(GF_STAT_EVENTS_LOST);
	stat_max(GF_STAT_LOST_BACKLOG_MAX, avail);
	stat_add(avail + len > ring - 1 ? GF_STAT_LOST_FULL : GF_STAT_LOST_ROOM);
}

static __always_inline struct gf_task *task_scratch(bool create)
{
	return bpf_task_storage_get(&tasks, bpf_get_current_task_btf(), 0,
				    create ? BPF_LOCAL_STORAGE_GET_F_CREATE : 0);
}

/*
 * Argument i (1-based) straight from the registers: no stack copy. The
 * empty asm after each load keeps clang from merging the cases into one
 * load through a computed ctx pointer, which the verifier rejects.
 */
#define GF_KEEP(v) asm volatile("" : "+r"(v))
static __always_inline __u64 reg_arg(const struct gf_regs *r, __u32 i)
{
	__u64 v = 0;

	switch (i) {
	case 1: v = r->di; GF_KEEP(v); break;
	case 2: v = r->si; GF_KEEP(v); break;
	case 3: v = r->dx; GF_KEEP(v); break;
	case 4: v = r->cx; GF_KEEP(v); break;
	case 5: v = r->r8; GF_KEEP(v); break;
	case 6: v = r->r9; GF_KEEP(v); break;
	}
	return v;
}

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

static __always_inline bool pred_holds(const struct gf_spec *s, const struct gf_regs *r)
{
	__u64 v;

	if (!s->pred_arg || s->pred_op == GF_PRED_NONE)
		return true;
	if (s->pred_arg > GF_NARGS)
		return false;
	v = reg_arg(r, s->pred_arg);
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

/*
 * The caller filter: at the entry the return address sits at [sp], so
 * "who called" is one user read. A probe on a C library function also
 * hits the library's own internal calls (read() under fgets()); this
 * limits a fault to calls made from one object, e.g. the application.
 */
static __always_inline bool caller_in(const struct gf_spec *s, const struct gf_regs *r)
{
	__u64 ra = 0;

	if (bpf_probe_read_user(&ra, sizeof(ra), (void *)r->sp))
		return false;
	return ra >= s->caller_lo && ra < s->caller_hi;
}

/* The trigger: does this matching call (number seq, at time now) fire? */
static __always_inline bool should_fire(const struct gf_spec *s,
					struct gf_counters *c, __u64 seq, __u64 now)
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
	/* Sticky: every call numbered after the one that first fired. Not
	 * every call that merely arrives later: with 8 threads, call 100 can
	 * enter after call 101 fired, and it is not "after 100". */
	if ((s->flags & GF_F_STICKY) && c->sticky && seq > c->sticky) {
		__sync_fetch_and_add(&c->fires, 1);
		return true;
	}
	if (s->nth && seq != s->nth)
		return false;
	if (s->every && seq % s->every)
		return false;
	if (s->after && seq <= s->after)
		return false;
	if (s->prob_ppm && bpf_get_prandom_u32() % 1000000 >= s->prob_ppm)
		return false;
	/* Claim a fire; give it back if that overshoots max (exact count). */
	n = __sync_fetch_and_add(&c->fires, 1);
	if (s->max_fires && n >= s->max_fires) {
		__sync_fetch_and_add(&c->fires, -1);
		return false;
	}
	return true;	/* the caller makes it sticky once its record is reserved */
}

/*
 * A fault fires only with its evidence record in hand: the record is
 * reserved before anything is done to the call, and a fire that finds the
 * ring full is given back and counted as skipped. So the recorded fires
 * are exactly what the target saw, never fewer.
 */
static __always_inline void give_back(struct gf_counters *c)
{
	__sync_fetch_and_add(&c->fires, -1);
	stat_add(GF_STAT_FIRES_SKIPPED);
}

static __always_inline struct gf_fire_event *reserve_fire(const struct gf_spec *s,
							  struct gf_counters *c, __u64 seq)
{
	struct gf_fire_event *e = bpf_ringbuf_reserve(&fires, sizeof(*e), 0);

	if (!e) {
		give_back(c);
		return 0;
	}
	/* The first fire names the call that later ones must follow; a racing
	 * fire with another number went through the full trigger anyway. */
	if (s->flags & GF_F_STICKY)
		__sync_val_compare_and_swap(&c->sticky, 0, seq);
	return e;
}

/*
 * The top of the user stack, from the page holding sp up, one page per
 * read: a read that crosses the stack's top fails as a whole (the copy of
 * a shallow thread would be nothing), a page is mapped or not. What is
 * below sp in the first page is copied too (a few KiB at most) and never
 * read by the unwinder.
 */
static __always_inline void emit_ustack(__u64 sp, __u64 fault_seq)
{
	struct gf_ustack_event *u;
	__u64 base = sp & ~(__u64)(GF_USTACK_PAGE - 1);
	__u32 i;

	if (!ustack_pages)	/* copies off at load: not even a header */
		return;
	u = bpf_ringbuf_reserve(&ustacks, sizeof(*u) + ustack_pages * GF_USTACK_PAGE, 0);
	if (!u) {
		stat_add(GF_STAT_USTACKS_LOST);
		return;
	}
	u->hdr.kind = GF_REC_USTACK;
	u->hdr.size = sizeof(*u) + ustack_pages * GF_USTACK_PAGE;
	u->fault_seq = fault_seq;
	u->base = base;
	u->len = ustack_pages * GF_USTACK_PAGE;
	for (i = 0; i < GF_USTACK_PAGES; i++) {
		if (i >= ustack_pages)
			break;
		if (bpf_probe_read_user((char *)(u + 1) + i * GF_USTACK_PAGE,
					GF_USTACK_PAGE, (void *)(base + i * GF_USTACK_PAGE)))
			break;
	}
	u->got = i ? (__s32)(i * GF_USTACK_PAGE) : -14;	/* -EFAULT */
	/* No wake-up: the fire record right after it wakes the consumer
	 * (a signal-path fire when this ring or its own crosses a quarter). */
	bpf_ringbuf_submit(u, BPF_RB_NO_WAKEUP);
}

static __always_inline void emit_fire(struct gf_regs *ctx, const struct gf_spec *s,
				      struct gf_task *w, struct gf_fire_event *e)
{
	e->hdr.kind = GF_REC_FIRE;
	e->hdr.size = sizeof(*e);
	e->fault_seq = w->inf.fault_seq;
	e->ts_ns = w->inf.ts_ns;
	e->cookie = w->cookie;
	e->call_seq = w->inf.call_seq;
	e->pid = bpf_get_current_pid_tgid() >> 32;
	e->tid = w->tid;
	e->action = s->action;
	e->mech = w->mech;
	e->retval = s->retval;
	e->flags = s->flags;
	__builtin_memcpy(e->regs, ctx, sizeof(e->regs));
	bpf_get_current_comm(e->comm, sizeof(e->comm));
	/* At the entry the caller's return address is at [sp]; the frame
	 * pointer walk below starts from the caller's frame and so skips the
	 * caller itself. Keep it: it becomes the first caller frame. */
	if (bpf_probe_read_user(&e->caller, sizeof(e->caller), (void *)ctx->sp))
		e->caller = 0;
	e->stack_bytes = 0;
	if (s->flags & GF_F_CAP_STACK)
		e->stack_bytes = bpf_get_stack(ctx, e->stack, sizeof(e->stack),
					       BPF_F_USER_STACK);
	/* The stack copy goes in first: the controller has it when it reads
	 * the fire. Only here, at a fire: armed-not-firing costs nothing more. */
	if (s->flags & GF_F_CAP_USTACK)
		emit_ustack(ctx->sp, e->fault_seq);
	/* No wake-up per fire: nothing waits for the record but the evidence,
	 * read at the controller's next poll (50 ms) or at once when the
	 * backlog crosses a quarter of the ring. A fire the in-target helper
	 * carries out (GF_MECH_SIGNAL): the wake-up (irq_work's self-IPI, a
	 * VM exit under KVM) was ~8 us of the ~9.5 us injected call on the
	 * dev VM (docs/benchmarks.md). A copilot fire: the woken consumer
	 * took the controller's GIL and CPU just as the copilot woke for the
	 * same fire, and the target's thread stayed stopped ~1 ms longer in
	 * a threaded server (bench/bench_copilot.py --shape server). */
	{
		__u64 avail = bpf_ringbuf_query(&fires, BPF_RB_AVAIL_DATA);
		__u64 q = bpf_ringbuf_query(&fires, BPF_RB_RING_SIZE) / 4;
		bool wake = avail >= q && avail < q + sizeof(*e) + 8;

		/* The stack copies' ring (~500 copies) fills long before the
		 * fires' does: its crossing wakes the consumer too. */
		if (s->flags & GF_F_CAP_USTACK && ustack_pages) {
			__u64 rec = sizeof(struct gf_ustack_event) +
				    ustack_pages * GF_USTACK_PAGE + 8;
			__u64 ua = bpf_ringbuf_query(&ustacks, BPF_RB_AVAIL_DATA);
			__u64 uq = bpf_ringbuf_query(&ustacks, BPF_RB_RING_SIZE) / 4;

			wake = wake || (ua >= uq && ua < uq + rec);
		}
		bpf_ringbuf_submit(e, wake ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
	}
}

/* One call record. lat == 0: entry only. Args come from the task scratch. */
static __always_inline void emit_call(struct gf_task *w, __u32 kind, __u64 ts,
				      __u64 lat, __u64 seq, __s64 ret)
{
	struct gf_call_event *e;
	__u64 avail;

	e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		events_lost(sizeof(*e));
		return;
	}
	e->ts_ns = ts;
	e->latency_ns = lat;
	e->cookie = w->cookie;
	e->call_seq = kind == GF_EV_FOLLOW && lat == 0 ? 0 : w->inf.call_seq;
	e->fault_seq = seq;
	__builtin_memcpy(e->args, w->inf.args, sizeof(e->args));
	e->ret = ret;
	e->pid = bpf_get_current_pid_tgid() >> 32;
	e->tid = w->tid;
	e->hdr.kind = kind;
	e->hdr.size = sizeof(*e);
	/*
	 * A wake-up per record costs more than the record: wake the consumer
	 * only when this record makes the backlog cross the threshold (it also
	 * polls on a short timer, which covers a crossing raced by two CPUs).
	 */
	avail = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA);
	bpf_ringbuf_submit(e, avail >= events_wake_bytes &&
			   avail < events_wake_bytes + sizeof(*e) + 8 ?
			   BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
}

/* The observe fast path: one entry record straight from the registers. */
static __always_inline void emit_entry_fast(struct gf_regs *ctx, __u64 cookie,
					    __u64 call_seq)
{
	struct gf_call_event *e;
	__u64 id, avail;

	e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
	if (!e) {
		events_lost(sizeof(*e));
		return;
	}
	id = bpf_get_current_pid_tgid();
	e->ts_ns = bpf_ktime_get_ns();
	e->latency_ns = 0;
	e->cookie = cookie;
	e->call_seq = call_seq;
	e->fault_seq = 0;
	e->args[0] = ctx->di;
	e->args[1] = ctx->si;
	e->args[2] = ctx->dx;
	e->args[3] = ctx->cx;
	e->args[4] = ctx->r8;
	e->args[5] = ctx->r9;
	e->ret = 0;
	e->pid = id >> 32;
	e->tid = (__u32)id;
	e->hdr.kind = GF_EV_ENTRY;
	e->hdr.size = sizeof(*e);
	avail = bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA);
	bpf_ringbuf_submit(e, avail >= events_wake_bytes &&
			   avail < events_wake_bytes + sizeof(*e) + 8 ?
			   BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP);
}

/* Hand the rest of a fire to the copilot: state first, then the signal. */
static __always_inline void to_copilot(struct gf_regs *ctx, const struct gf_spec *s,
				       struct gf_task *w, __u64 corrupt_addr)
{
	struct gf_pending *p = &w->pend;

	p->fault_seq = w->inf.fault_seq;
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
	if (bpf_map_update_elem(&pending, &w->tid, p, BPF_ANY)) {
		stat_add(GF_STAT_PENDING_ERR);
		return;
	}
	if (bpf_send_signal_thread(copilot_signo))
		stat_add(GF_STAT_SIGNAL_ERR);
}

static __always_inline void fire_at_entry(struct gf_regs *ctx, const struct gf_spec *s,
					  struct gf_task *w, struct gf_fire_event *e,
					  const bool regs_ok)
{
	w->inf.fault_seq = __sync_fetch_and_add(&fault_seq_ctr, 1) + 1;
	w->mech = GF_MECH_BPF;
	if (s->action == GF_ACT_STALL)
		w->mech = (s->flags & GF_F_SIGNAL) ? GF_MECH_SIGNAL : GF_MECH_COPILOT;
	if (s->action == GF_ACT_FAIL)
		w->mech = regs_ok ? GF_MECH_REGS :
			  (s->flags & GF_F_SIGNAL) ? GF_MECH_SIGNAL : GF_MECH_COPILOT;
	if (s->action == GF_ACT_CORRUPT && (s->flags & GF_F_COPILOT))
		w->mech = GF_MECH_COPILOT;
	emit_fire(ctx, s, w, e);

	if (s->action == GF_ACT_SIGNAL) {
		if (bpf_send_signal_thread(s->signo))
			stat_add(GF_STAT_SIGNAL_ERR);
	} else if (s->action == GF_ACT_STALL && (s->flags & GF_F_SIGNAL)) {
		/* The helper's handler waits on its own clock (pyctl/fastpath). */
		if (bpf_send_signal_thread(helper_signo))
			stat_add(GF_STAT_SIGNAL_ERR);
	} else if (s->action == GF_ACT_STALL) {
		to_copilot(ctx, s, w, 0);
	} else if (s->action == GF_ACT_FAIL && !(s->flags & GF_F_AFTER)) {
		if (!regs_ok && (s->flags & GF_F_SIGNAL)) {
			/* The helper's handler returns at once (pyctl/fastpath):
			 * it knows each site's entry sp from its probed insn. */
			if (bpf_send_signal_thread(helper_signo))
				stat_add(GF_STAT_SIGNAL_ERR);
			return;
		}
		if (!regs_ok) {
			to_copilot(ctx, s, w, 0);
			return;
		}
		/* Return at once: ip = return address, pop it, ax = value. */
		if (bpf_probe_read_user(&w->ra, sizeof(w->ra), (void *)ctx->sp)) {
			stat_add(GF_STAT_CORRUPT_ERR);
			return;
		}
		ctx->ax = s->retval;
		ctx->ip = w->ra;
		ctx->sp += 8;
	}
}

static __always_inline int do_entry(struct gf_regs *ctx, const bool regs_ok)
{
	__u64 cookie = bpf_get_attach_cookie(ctx);
	__u32 si = GF_COOKIE_SPEC(cookie);
	struct gf_fire_event *fe;
	struct gf_counters *c;
	struct gf_spec *s;
	struct gf_task *w;
	__u64 id, seq, now;
	bool fire;

	s = bpf_map_lookup_elem(&specs, &si);
	if (!s || !(s->flags & GF_F_ENABLED))
		return 0;
	/* Armed before its probes go in, entry probes first (links.py): until
	 * the controller sets GF_F_RETPROBE, once the return probe is in too,
	 * a call is an entry-only one. A fault carried out at the return
	 * counts nothing until then: it could fire and never happen. */
	if (!(s->flags & GF_F_RETPROBE) &&
	    ((s->flags & GF_F_AFTER) || s->action == GF_ACT_CORRUPT))
		return 0;
	/* Who and the predicate first: armed-not-matching costs little. */
	id = bpf_get_current_pid_tgid();
	if (s->tgid && s->tgid != id >> 32)
		return 0;
	if (s->tid && s->tid != (__u32)id)
		return 0;
	if (!pred_holds(s, ctx))
		return 0;
	if (s->caller_hi && !caller_in(s, ctx))
		return 0;
	c = bpf_map_lookup_elem(&counters, &si);
	if (!c)
		return 0;
	if (s->action == GF_ACT_OBSERVE && !(s->flags & GF_F_RETPROBE)) {
		/* Entry-only trace: nothing to keep, so no task storage. */
		if (s->flags & GF_F_TRACE)
			emit_entry_fast(ctx, cookie, __sync_fetch_and_add(&c->calls, 1) + 1);
		else
			__sync_fetch_and_add(&c->calls, 1);
		return 0;
	}
	seq = __sync_fetch_and_add(&c->calls, 1) + 1;
	now = bpf_ktime_get_ns();
	fire = should_fire(s, c, seq, now);
	/* Armed, not firing, nothing to follow to the return: done, cheaply. */
	if (!fire && !(s->flags & (GF_F_RETPROBE | GF_F_TRACE)))
		return 0;
	w = task_scratch(true);
	if (!w) {
		stat_add(GF_STAT_INFLIGHT_ERR);
		if (fire)	/* no scratch to carry it out: it does not happen */
			give_back(c);
		return 0;
	}
	w->cookie = cookie;
	w->tid = (__u32)bpf_get_current_pid_tgid();
	w->inf.args[0] = ctx->di;
	w->inf.args[1] = ctx->si;
	w->inf.args[2] = ctx->dx;
	w->inf.args[3] = ctx->cx;
	w->inf.args[4] = ctx->r8;
	w->inf.args[5] = ctx->r9;
	w->inf.call_seq = seq;
	w->inf.ts_ns = now;
	w->inf.fault_seq = 0;
	w->inf.fired = 0;
	if (fire) {
		/* The record is used in this block alone: older verifiers (6.1)
		 * lose a reservation tested twice. */
		fe = reserve_fire(s, c, seq);
		if (fe) {
			w->inf.fired = 1;
			fire_at_entry(ctx, s, w, fe, regs_ok);
		}
	}

	if (s->flags & GF_F_RETPROBE) {
		w->k.tid = w->tid;
		w->k.cookie_lo = GF_COOKIE_FUNC(w->cookie);
		w->k.spec = GF_COOKIE_SPEC(w->cookie);
		w->k.pad = 0;
		if (bpf_map_update_elem(&inflight, &w->k, &w->inf, BPF_ANY))
			stat_add(GF_STAT_INFLIGHT_ERR);
	} else if ((s->flags & GF_F_TRACE) || w->inf.fired) {
		/* No return probe: the entry is all we will see of this call. */
		emit_call(w, GF_EV_ENTRY, w->inf.ts_ns, 0, w->inf.fault_seq,
			  w->inf.fired && s->action == GF_ACT_FAIL ? s->retval : 0);
		if (w->inf.fired)
			bpf_map_update_elem(&follow, &w->tid, &w->inf.fault_seq, BPF_ANY);
	}
	return 0;
}

static __always_inline void do_corrupt(struct gf_regs *ctx, const struct gf_spec *s,
				       struct gf_task *w, const bool wu_ok)
{
	void *p;

	if (!s->corrupt_arg || s->corrupt_arg > GF_NARGS)
		return;
	p = (void *)(arg_at(w->inf.args, s->corrupt_arg) + s->corrupt_off);
	if (!wu_ok) {
		/* Kernel lockdown forbids bpf_probe_write_user: copilot writes. */
		to_copilot(ctx, s, w, (__u64)p);
		return;
	}
	w->ra = 0;
	if (bpf_probe_read_user(&w->ra, sizeof(w->ra), p)) {
		stat_add(GF_STAT_CORRUPT_ERR);
		return;
	}
	if (s->corrupt_op == GF_CORRUPT_XOR)
		w->ra ^= s->corrupt_mask;
	else if (s->corrupt_op == GF_CORRUPT_SET)
		w->ra = s->corrupt_mask;
	else
		w->ra = 0;
	/* Write exactly corrupt_len bytes (little endian low bytes). */
	switch (s->corrupt_len) {
	case 1: if (bpf_probe_write_user(p, &w->ra, 1)) goto err; break;
	case 2: if (bpf_probe_write_user(p, &w->ra, 2)) goto err; break;
	case 4: if (bpf_probe_write_user(p, &w->ra, 4)) goto err; break;
	default: if (bpf_probe_write_user(p, &w->ra, 8)) goto err; break;
	}
	return;
err:
	stat_add(GF_STAT_CORRUPT_ERR);
}

/* The fired thread's next failing return: link it to the fault, once. */
static __always_inline void follow_check(struct gf_task *w, __u64 ts, __u64 lat,
					 __s64 ret)
{
	__u64 *fseq;

	if ((__u32)ret == 0)
		return;
	fseq = bpf_map_lookup_elem(&follow, &w->tid);
	if (!fseq)
		return;
	emit_call(w, GF_EV_FOLLOW, ts, lat, *fseq, ret);
	bpf_map_delete_elem(&follow, &w->tid);
}

static __always_inline int do_return(struct gf_regs *ctx, const bool regs_ok,
				     const bool wu_ok)
{
	__u64 cookie = bpf_get_attach_cookie(ctx);
	__u32 si = GF_COOKIE_SPEC(cookie);
	struct gf_inflight *inf;
	struct gf_spec *s;
	struct gf_task *w;

	s = bpf_map_lookup_elem(&specs, &si);
	w = task_scratch(false);
	if (!s || !w)
		return 0;	/* this thread never matched an entry */
	w->cookie = cookie;
	w->tid = (__u32)bpf_get_current_pid_tgid();
	w->k.tid = w->tid;
	w->k.cookie_lo = GF_COOKIE_FUNC(cookie);
	w->k.spec = si;
	w->k.pad = 0;
	inf = bpf_map_lookup_elem(&inflight, &w->k);
	if (!inf) {
		/* Not a matching call: only the fired thread's next error counts. */
		__builtin_memset(w->inf.args, 0, sizeof(w->inf.args));
		follow_check(w, bpf_ktime_get_ns(), 0, ctx->ax);
		return 0;
	}
	w->inf = *inf;
	bpf_map_delete_elem(&inflight, &w->k);
	w->ra = bpf_ktime_get_ns() - w->inf.ts_ns;	/* latency */
	if (w->inf.fired) {
		if (s->action == GF_ACT_FAIL && (s->flags & GF_F_AFTER)) {
			if (regs_ok)
				ctx->ax = s->retval;
			else
				to_copilot(ctx, s, w, 0);
			emit_call(w, GF_EV_CALL, w->inf.ts_ns, w->ra, w->inf.fault_seq,
				  s->retval);
		} else {
			if (s->action == GF_ACT_CORRUPT)
				do_corrupt(ctx, s, w, wu_ok);
			emit_call(w, GF_EV_CALL, w->inf.ts_ns, w->ra, w->inf.fault_seq,
				  ctx->ax);
		}
		bpf_map_update_elem(&follow, &w->tid, &w->inf.fault_seq, BPF_ANY);
		return 0;
	}
	if (s->flags & GF_F_TRACE)
		emit_call(w, GF_EV_CALL, w->inf.ts_ns, w->ra, 0, ctx->ax);
	follow_check(w, w->inf.ts_ns, w->ra, ctx->ax);
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

/* ---- how watched processes end: signals and exit (no module needed) ----
 *
 * BTF-typed tracepoints (tp_btf): attached by BTF id through
 * BPF_RAW_TRACEPOINT_OPEN, so they need no tracefs (a new machine has none
 * mounted) and receive the tracepoint's C arguments instead of its record.
 */

/* Only the field we read; CO-RE finds it inside the kernel's anonymous
 * __SIGINFO member. */
struct kernel_siginfo {
	int si_code;
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
	e->hdr.kind = GF_REC_PROC;
	e->hdr.size = sizeof(*e);
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

/* trace_signal_deliver(int sig, struct kernel_siginfo *info,
 *			 struct k_sigaction *ka): ctx[0], ctx[1]. */
SEC("tp_btf/signal_deliver")
int gf_signal_deliver(__u64 *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	struct kernel_siginfo *info = (void *)ctx[1];
	int sig = (int)ctx[0];
	int code = 0;

	if (!bpf_map_lookup_elem(&watched, &tgid))
		return 0;
	if (sig == (int)copilot_signo || sig == (int)helper_signo)	/* our own hand-offs */
		return 0;
	if (info)
		code = BPF_CORE_READ(info, si_code);
	emit_proc(GF_PROC_SIGNAL, sig, code);
	return 0;
}

/* trace_sched_process_exit(struct task_struct *p[, bool group_dead]): the
 * arguments changed across kernels, so read only the current task. */
SEC("tp_btf/sched_process_exit")
int gf_process_exit(__u64 *ctx)
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
