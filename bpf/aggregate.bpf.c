// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * In-kernel call summaries: counts, error returns and log2 latency
 * histograms kept in BPF maps, no ring event per call (bcc's funccount and
 * funclatency, for gpufault's functions). The controller
 * (pyctl/calls/aggregate.py) loads either
 *
 *   agg_count                 entry only: a count per function (cheapest)
 *   agg_session               count at entry; latency, errors at return: one
 *                             program on a uprobe session link (6.12+), the
 *                             entry time in the call's session cookie
 *   agg_entry + agg_return    the same for older kernels: an entry uprobe and
 *                             a uretprobe, the entry time on a per-thread
 *                             stack in task storage (~40 ns more a call on the H200)
 *
 * and reads the maps once, at the end. Each attachment's BPF cookie holds
 * the function index and its error rule (AGG_COOKIE in aggregate.h).
 *
 * Why the counters are atomic although the maps are per CPU: uprobe
 * programs run preemptibly (migrate_disable only), so a thread preempted
 * between a load and a store on this CPU would lose the other's update.
 * An uncontended atomic add on a CPU-local line costs a few ns.
 * Why the stack stays small (no big locals): kernels since 6.13 give a
 * program whose stack reaches 64 bytes a per-CPU private stack, which two
 * preempting threads on one CPU would share (see docs/benchmarks.md, "The
 * private-stack finding"); tests/test_aggregate.py checks the JIT prologue.
 */
#include <stdbool.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "aggregate.h"

/* Uprobe session kfuncs (6.12+); weak: the object still loads without them. */
extern bool bpf_session_is_return(void) __ksym __weak;
extern __u64 *bpf_session_cookie(void) __ksym __weak;

/* x86-64 struct pt_regs, the uprobe context (only ax is read). */
struct agg_regs {
	__u64 r15, r14, r13, r12, bp, bx, r11, r10, r9, r8;
	__u64 ax, cx, dx, si, di, orig_ax, ip, cs, flags, sp, ss;
};

/* Load-time settings (the controller fills .rodata before load). */
const volatile __u32 target_tgid = 0;	/* 0: any process */
const volatile bool per_thread = false;	/* key the stats by (func, tid) */

/* func -> stats, when not per thread (sized to the function count). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct agg_stats);
} stats SEC(".maps");

/* (func, tid) -> stats, when per thread. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct agg_key);
	__type(value, struct agg_stats);
} tstats SEC(".maps");

/* (func, tid, return value) -> count of error returns. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct agg_err_key);
	__type(value, __u64);
} errs SEC(".maps");

/* enum agg_misc -> count: what could not be measured, and why. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, AGG_MISC_MAX);
	__type(key, __u32);
	__type(value, __u64);
} misc SEC(".maps");

/*
 * Per-thread entry timestamps, a stack: returns come back in LIFO order,
 * so nested and recursive calls each get their own entry time.
 */
struct agg_slot {
	__u64 ts;
	__u32 func;
	__u32 pad;
};

struct agg_task {
	__u32 depth;		/* calls entered and not returned */
	__u32 pad;
	struct agg_slot slot[AGG_DEPTH];
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct agg_task);
} tasks SEC(".maps");

/* All zeros: the first value of a new per-thread entry. */
static struct agg_stats zero_stats;

static __always_inline void misc_add(__u32 idx)
{
	__u64 *v = bpf_map_lookup_elem(&misc, &idx);

	if (v)
		__sync_fetch_and_add(v, 1);
}

/* floor(log2(v)), 0 for 0 and 1, capped at the last slot. */
static __always_inline __u32 log2_slot(__u64 v)
{
	__u32 r, shift;

	r = (v > 0xFFFFFFFFULL) << 5;
	v >>= r;
	shift = (v > 0xFFFF) << 4;
	v >>= shift;
	r |= shift;
	shift = (v > 0xFF) << 3;
	v >>= shift;
	r |= shift;
	shift = (v > 0xF) << 2;
	v >>= shift;
	r |= shift;
	shift = (v > 0x3) << 1;
	v >>= shift;
	r |= shift;
	r |= (v >> 1);
	return r < AGG_SLOTS ? r : AGG_SLOTS - 1;
}

/* This function's (and thread's) stats, created on a thread's first call. */
static __always_inline struct agg_stats *stats_of(__u32 func, __u32 tid)
{
	struct agg_key k = { .func = func, .tid = tid };
	struct agg_stats *v;

	/* Not per thread: an array slot, always there. */
	if (!per_thread)
		return bpf_map_lookup_elem(&stats, &k.func);
	v = bpf_map_lookup_elem(&tstats, &k);
	if (v)
		return v;
	/* Another CPU may insert it first: NOEXIST, then look again. */
	bpf_map_update_elem(&tstats, &k, &zero_stats, BPF_NOEXIST);
	v = bpf_map_lookup_elem(&tstats, &k);
	if (!v)
		misc_add(AGG_MISC_FULL);
	return v;
}

/* One more error return with this value. */
static __always_inline void err_add(__u32 func, __u32 tid, __s64 ret)
{
	struct agg_err_key k = { .func = func, .tid = tid, .ret = ret };
	__u64 one = 1, *c;

	c = bpf_map_lookup_elem(&errs, &k);
	if (c) {
		__sync_fetch_and_add(c, 1);
		return;
	}
	/* New value: insert 1; if another CPU won the race, add to its entry. */
	if (!bpf_map_update_elem(&errs, &k, &one, BPF_NOEXIST))
		return;
	c = bpf_map_lookup_elem(&errs, &k);
	if (c)
		__sync_fetch_and_add(c, 1);
	else
		misc_add(AGG_MISC_FULL);	/* "errors" still counts it */
}

/* Count an entry (id: bpf_get_current_pid_tgid(), the caller filtered). */
static __always_inline int on_entry(void *ctx, __u64 id, const bool keep_ts)
{
	__u32 func = AGG_COOKIE_FUNC(bpf_get_attach_cookie(ctx));
	struct agg_stats *v;
	struct agg_task *t;
	__u32 d;

	/* Count the entry. */
	v = stats_of(func, per_thread ? (__u32)id : 0);
	if (v)
		__sync_fetch_and_add(&v->calls, 1);
	if (!keep_ts)
		return 0;
	/* Push the entry time on this thread's stack. */
	t = bpf_task_storage_get(&tasks, bpf_get_current_task_btf(), 0,
				 BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!t) {
		misc_add(AGG_MISC_NO_TASK);
		return 0;
	}
	d = t->depth;
	if (d < AGG_DEPTH) {
		t->slot[d & (AGG_DEPTH - 1)].func = func;
		/* Last, so the latency includes as little of this program as possible. */
		t->slot[d & (AGG_DEPTH - 1)].ts = bpf_ktime_get_ns();
	}
	t->depth = d + 1;
	return 0;
}

/* A completed call: its latency into the histogram, its error code. */
static __always_inline void on_return(struct agg_regs *ctx, __u64 cookie, __u32 tid,
				      __u64 lat)
{
	__u32 func = AGG_COOKIE_FUNC(cookie);
	struct agg_stats *v;

	v = stats_of(func, tid);
	if (!v)
		return;
	/* Add the latency to the histogram (its sum is the return count). */
	__sync_fetch_and_add(&v->lat_sum, lat);
	__sync_fetch_and_add(&v->hist[log2_slot(lat)], 1);
	/* Racy only against a thread that preempts this one on this CPU. */
	if (lat > v->lat_max)
		v->lat_max = lat;
	/* Classify the return value by the function's rule. */
	if (AGG_COOKIE_RULE(cookie) == AGG_ERR_NONZERO32 && (__s32)ctx->ax != 0) {
		__sync_fetch_and_add(&v->errors, 1);
		err_add(func, tid, (__s32)ctx->ax);
	}
}

SEC("uprobe")
int agg_count(void *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();

	/* Filter first: a call of another process costs the least. */
	if (target_tgid && (id >> 32) != target_tgid)
		return 0;
	return on_entry(ctx, id, false);
}

SEC("uprobe")
int agg_entry(void *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();

	if (target_tgid && (id >> 32) != target_tgid)
		return 0;
	return on_entry(ctx, id, true);
}

SEC("uretprobe")
int agg_return(struct agg_regs *ctx)
{
	/* The time first: the latency includes as little of this as possible. */
	__u64 now = bpf_ktime_get_ns();
	__u64 id = bpf_get_current_pid_tgid();
	__u64 cookie = bpf_get_attach_cookie(ctx);
	__u32 func = AGG_COOKIE_FUNC(cookie);
	struct agg_task *t;
	__u64 lat;
	__u32 d;

	if (target_tgid && (id >> 32) != target_tgid)
		return 0;
	/* Pop this call's entry (none: it entered before the probes). */
	t = bpf_task_storage_get(&tasks, bpf_get_current_task_btf(), 0, 0);
	if (!t || !t->depth)
		return 0;
	d = t->depth - 1;
	t->depth = d;
	if (d >= AGG_DEPTH) {
		misc_add(AGG_MISC_DEEP);
		return 0;
	}
	if (t->slot[d & (AGG_DEPTH - 1)].func != func) {
		misc_add(AGG_MISC_UNMATCHED);
		return 0;
	}
	lat = now - t->slot[d & (AGG_DEPTH - 1)].ts;
	on_return(ctx, cookie, per_thread ? (__u32)id : 0, lat);
	return 0;
}

SEC("uprobe")
int agg_session(struct agg_regs *ctx)
{
	__u64 *ts = bpf_session_cookie();
	__u64 id, now;

	if (bpf_session_is_return()) {
		/* The time first: the latency includes as little of this as possible. */
		now = bpf_ktime_get_ns();
		id = bpf_get_current_pid_tgid();
		on_return(ctx, bpf_get_attach_cookie(ctx), per_thread ? (__u32)id : 0,
			  now - *ts);
		return 0;
	}
	/* Entry: another process's call wants no return probe (1: skip it). */
	id = bpf_get_current_pid_tgid();
	if (target_tgid && (id >> 32) != target_tgid)
		return 1;
	on_entry(ctx, id, false);
	/* The entry time in this call's cookie, last: see on_entry. */
	*ts = bpf_ktime_get_ns();
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
