/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Types shared by the BPF programs (gpufault.bpf.c) and the Python
 * controller (pyctl/bpf/abi.py mirrors every struct here; a test compiles
 * a C program that prints sizeof/offsetof and compares).
 *
 * Plain C with fixed-width types only: no vmlinux.h, no kernel headers.
 */
#ifndef __GPUFAULT_H
#define __GPUFAULT_H

#define GF_ABI_VERSION 3

#define GF_MAX_SPECS 64		/* fault specs (incl. observe) per run */
#define GF_NARGS 6		/* integer argument registers (SysV x86-64) */
#define GF_NREGS 21		/* longs in x86-64 struct pt_regs */
#define GF_MAX_STACK 32		/* user stack frames kept per fire */
#define GF_COMM_LEN 16
#define GF_USTACK_PAGE 4096	/* the stack copy is read page by page */
#define GF_USTACK_PAGES 8	/* at most 32 KiB of stack copied per fire */

/*
 * The BPF cookie of every attachment: which spec it serves and which
 * function (an index into the controller's attachment table) it is.
 */
#define GF_COOKIE(spec, func) (((__u64)(spec) << 32) | (__u32)(func))
#define GF_COOKIE_SPEC(c) ((__u32)((c) >> 32))
#define GF_COOKIE_FUNC(c) ((__u32)(c))

enum gf_action {
	GF_ACT_OBSERVE = 0,
	GF_ACT_FAIL = 1,	/* return spec.retval */
	GF_ACT_SIGNAL = 2,	/* send spec.signo to the calling thread */
	GF_ACT_CORRUPT = 3,	/* at return, rewrite memory an arg points to */
	GF_ACT_STALL = 4,	/* stop the calling thread (copilot) */
};

/* How a fire is carried out; reported in every fire event. */
enum gf_mech {
	GF_MECH_BPF = 0,	/* done in BPF alone (observe, signal, corrupt) */
	GF_MECH_REGS = 1,	/* BPF wrote pt_regs (kernels that allow it) */
	GF_MECH_COPILOT = 2,	/* ptrace copilot finishes it at a signal stop */
	GF_MECH_SIGNAL = 3,	/* the target's gfsig helper, at the signal */
};

enum gf_spec_flags {
	GF_F_ENABLED = 1 << 0,
	GF_F_STICKY = 1 << 1,	/* once fired, fire on every later match */
	GF_F_AFTER = 1 << 2,	/* fail: run the body, then replace ax */
	GF_F_TRACE = 1 << 3,	/* emit a call event per call (trace mode) */
	/* 1 << 4: free (was CAP_REGS: fire events always carry the registers) */
	GF_F_CAP_STACK = 1 << 5, /* keep the user stack in fire events */
	GF_F_REGS = 1 << 6,	/* use the regs mechanism (set by controller) */
	GF_F_COPILOT = 1 << 7,	/* use the copilot mechanism */
	GF_F_RETPROBE = 1 << 8,	/* its return probe is attached (set after) */
	GF_F_CAP_USTACK = 1 << 9, /* copy the top of the user stack at a fire */
	GF_F_SIGNAL = 1 << 10,	/* fail skip, stall: the in-target helper's handler */
};

enum gf_pred_op {
	GF_PRED_NONE = 0,
	GF_PRED_EQ = 1,
	GF_PRED_NE = 2,
	GF_PRED_LT = 3,		/* unsigned compares */
	GF_PRED_GT = 4,
	GF_PRED_LE = 5,
	GF_PRED_GE = 6,
	GF_PRED_MASK = 7,	/* (arg & val) != 0 */
};

enum gf_corrupt_op {
	GF_CORRUPT_ZERO = 0,
	GF_CORRUPT_XOR = 1,
	GF_CORRUPT_SET = 2,
};

/* One fault spec: where is the cookie, what/when/who/how long is here. */
struct gf_spec {
	__u32 action;		/* enum gf_action */
	__u32 flags;		/* enum gf_spec_flags */
	__s64 retval;		/* fail: value put in ax */
	__u32 tgid;		/* 0 = any process */
	__u32 tid;		/* 0 = any thread */
	__u64 nth;		/* fire only on this matching call (1-based) */
	__u64 every;		/* fire when call % every == 0 */
	__u64 after;		/* fire only when call > after */
	__u64 max_fires;	/* 0 = unlimited */
	__u32 prob_ppm;		/* 0 = always; else fire with p = ppm/1e6 */
	__u32 signo;		/* signal action */
	__u64 window_start_ns;	/* bpf_ktime_get_ns(); 0 = from the start */
	__u64 deadline_ns;	/* bpf_ktime_get_ns(); 0 = none */
	__u32 pred_arg;		/* 0 = no predicate, 1..6 = argN */
	__u32 pred_op;		/* enum gf_pred_op */
	__u64 pred_val;
	__u32 corrupt_arg;	/* 1..6: the pointer argument */
	__u32 corrupt_op;	/* enum gf_corrupt_op */
	__u32 corrupt_off;	/* byte offset from the pointer */
	__u32 corrupt_len;	/* 1..8 bytes */
	__u64 corrupt_mask;	/* XOR mask or SET value (little endian) */
	__u64 stall_ns;		/* stall: 0 = until released or deadline */
	__u64 caller_lo;	/* fire only when the return address at entry */
	__u64 caller_hi;	/* is in [lo, hi); hi == 0: any caller */
};

/* Per-spec counters, updated atomically by every CPU. */
struct gf_counters {
	__u64 calls;		/* calls that matched who + predicate */
	__u64 fires;
	__u64 sticky;		/* call number of a sticky spec's first fire, 0 before */
	__u64 expired;		/* matching calls after the deadline */
};

/* What a ring record is: struct gf_hdr.kind. */
enum gf_rec_kind {
	GF_EV_CALL = 1,		/* events: a completed call: entry + return */
	GF_EV_ENTRY = 2,	/* events: entry only (no return probe) */
	GF_EV_FOLLOW = 3,	/* events: the fired thread's next failing return */
	GF_REC_FIRE = 4,	/* fires: struct gf_fire_event */
	GF_REC_PROC = 5,	/* fires: struct gf_proc_event */
	GF_REC_USTACK = 6,	/* ustacks: struct gf_ustack_event + the copy */
};

/*
 * The first member of every ring record: the reader tells records apart
 * by kind and refuses one whose size is not its mirror's (an object built
 * from another header), instead of misreading it.
 */
struct gf_hdr {
	__u32 kind;		/* enum gf_rec_kind */
	__u32 size;		/* sizeof the whole record */
};

/*
 * Ring "events": small fixed-size records, one per observed call. Every
 * record has the same size so the consumer can parse a batch at once.
 */
struct gf_call_event {
	struct gf_hdr hdr;	/* kind: GF_EV_CALL, GF_EV_ENTRY or GF_EV_FOLLOW */
	__u64 ts_ns;		/* entry, bpf_ktime_get_ns() */
	__u64 latency_ns;	/* 0 for GF_EV_ENTRY */
	__u64 cookie;
	__u64 call_seq;		/* spec's matching-call number, 0 = no match */
	__u64 fault_seq;	/* != 0: this call fired (or follows) a fault */
	__u64 args[GF_NARGS];
	__s64 ret;
	__u32 pid;
	__u32 tid;
};

/* Ring "fires": one large record per fire of a fault. */
struct gf_fire_event {
	struct gf_hdr hdr;	/* GF_REC_FIRE */
	__u64 fault_seq;	/* unique in the run, from 1 */
	__u64 ts_ns;
	__u64 cookie;
	__u64 call_seq;
	__u32 pid;
	__u32 tid;
	__u32 action;
	__u32 mech;		/* enum gf_mech */
	__s64 retval;
	__u32 flags;		/* spec flags at the time */
	__s32 stack_bytes;	/* bytes of stack[] used, < 0: error */
	__u64 regs[GF_NREGS];	/* struct pt_regs at entry (or return) */
	char comm[GF_COMM_LEN];
	__u64 caller;		/* [sp] at entry: the return address, 0 if unread */
	__u64 stack[GF_MAX_STACK];
};

/*
 * Ring "ustacks": the top of a fired thread's user stack, for unwinding
 * with the binaries' call-frame information (perf's --call-graph dwarf
 * copy). hdr.size is sizeof(struct gf_ustack_event) + len: `len` bytes
 * follow the struct, the memory from `base` up. Copied page by page from
 * the page holding regs.sp (a read across the stack's top would fail as
 * a whole), so `got` is a multiple of the page size, or < 0 (no page
 * read). Submitted before its fire record, so the controller holds it
 * when it reads the fire. Own ring: a copy that finds no room is lost
 * (stat ustacks_lost) and the fire still happens, with its fp stack.
 */
struct gf_ustack_event {
	struct gf_hdr hdr;	/* GF_REC_USTACK */
	__u64 fault_seq;	/* the fire this copy belongs to */
	__u64 base;		/* user address of the first byte copied */
	__u32 len;		/* bytes reserved after the struct */
	__s32 got;		/* bytes copied from base, < 0: error */
};

enum gf_proc_kind {
	GF_PROC_SIGNAL = 1,	/* a signal delivered to a watched process */
	GF_PROC_EXIT = 2,	/* a watched process's last thread exited */
};

/* Ring "fires" also carries these (told apart by hdr.kind). */
struct gf_proc_event {
	struct gf_hdr hdr;	/* GF_REC_PROC */
	__u64 ts_ns;
	__u32 pid;
	__u32 tid;
	__u32 kind;
	__s32 signo;		/* signal number, or exit signal */
	__s32 code;		/* si_code, or exit code */
	__u32 pad;
	char comm[GF_COMM_LEN];
};

/*
 * Map "pending", keyed by tid: what the copilot must do at this thread's
 * next signal stop. Written before bpf_send_signal_thread().
 */
struct gf_pending {
	__u64 fault_seq;
	__u64 regs[GF_NREGS];	/* entry regs (skip) or return regs (after) */
	__s64 retval;
	__u64 stall_ns;
	__u64 deadline_ns;	/* spec deadline, bpf_ktime_get_ns() */
	__u32 action;
	__u32 flags;		/* spec flags: GF_F_AFTER tells skip/after */
	/* corrupt where BPF may not write user memory (kernel lockdown) */
	__u64 corrupt_addr;	/* where to write (arg + offset) */
	__u64 corrupt_mask;
	__u32 corrupt_op;
	__u32 corrupt_len;
};

/* Map "inflight" value, keyed by (tid, func): entry state for return. */
struct gf_inflight {
	__u64 ts_ns;
	__u64 call_seq;
	__u64 fault_seq;
	__u64 args[GF_NARGS];
	__u32 fired;
	__u32 pad;
};

/* Indexes of the global "stats" array (all __u64, atomically added). */
enum gf_stat {
	GF_STAT_EVENTS_LOST = 0,	/* events ring full */
	GF_STAT_FIRES_LOST = 1,		/* fires ring full: a process event lost */
	GF_STAT_SIGNAL_ERR = 2,		/* bpf_send_signal_thread failed */
	GF_STAT_PENDING_ERR = 3,	/* pending map full */
	GF_STAT_INFLIGHT_ERR = 4,	/* inflight map full */
	GF_STAT_CORRUPT_ERR = 5,	/* user memory write failed */
	GF_STAT_FIRES_SKIPPED = 6,	/* no room for a fire's record: not fired */
	/* Why an events reservation failed, from the ring as seen right
	 * after it (docs/benchmarks.md, "Lost events"): */
	GF_STAT_LOST_FULL = 7,		/* no room before the consumer */
	GF_STAT_LOST_ROOM = 8,		/* room when looked at: lock, uncommitted
					 * record, or the consumer moved */
	GF_STAT_LOST_BACKLOG_MAX = 9,	/* most bytes unread seen at a loss */
	GF_STAT_USTACKS_LOST = 10,	/* ustacks ring full: a stack copy lost */
	GF_STAT_MAX = 11,
};

#endif /* __GPUFAULT_H */
