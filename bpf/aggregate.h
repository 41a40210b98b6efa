/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Types shared by the in-kernel aggregation programs (aggregate.bpf.c) and
 * the Python controller (pyctl/bpf/aggregate_abi.py mirrors every struct
 * here; tests/test_aggregate_abi.py compiles a C program that prints
 * sizeof/offsetof and compares).
 *
 * No event per call: each call adds to per-function (or per-function and
 * thread) counters and a log2 latency histogram in maps that the
 * controller reads once, at the end.
 *
 * Plain C with fixed-width types only: no vmlinux.h, no kernel headers.
 */
#ifndef __GF_AGGREGATE_H
#define __GF_AGGREGATE_H

#define AGG_SLOTS 40		/* log2 ns buckets: slot k = [2^k, 2^(k+1)), the
				 * last one everything from 2^39 ns (~9 min) up */
#define AGG_DEPTH 16		/* nested probed calls per thread with a latency */
#define AGG_MISC_MAX 4

/*
 * The BPF cookie of every attachment: the function index (into the
 * controller's table) and how its return value says "error".
 */
#define AGG_COOKIE(rule, func) (((__u64)(rule) << 32) | (__u32)(func))
#define AGG_COOKIE_FUNC(c) ((__u32)(c))
#define AGG_COOKIE_RULE(c) ((__u32)((c) >> 32))

enum agg_err_rule {
	AGG_ERR_NONE = 0,	/* the return value is not classified */
	AGG_ERR_NONZERO32 = 1,	/* (int)ret != 0: CUresult, ncclResult_t, ... */
};

enum agg_misc {
	AGG_MISC_NO_TASK = 0,	/* task storage unavailable: no latency */
	AGG_MISC_DEEP = 1,	/* nested deeper than AGG_DEPTH: no latency */
	AGG_MISC_UNMATCHED = 2,	/* a return whose entry slot is another function's */
	AGG_MISC_FULL = 3,	/* a per-thread or error-code map was full */
};

/* Key of the per-thread stats map and of the error-code map's owner. */
struct agg_key {
	__u32 func;		/* function index */
	__u32 tid;		/* 0 unless per-thread counting was asked */
};

/* One function's (or function and thread's) numbers, per CPU. */
struct agg_stats {
	__u64 calls;		/* entries counted */
	__u64 returns;		/* unused: sum(hist) counts the returns */
	__u64 errors;		/* returns the function's rule calls errors */
	__u64 lat_sum;		/* ns, over `returns` */
	__u64 lat_max;		/* ns */
	__u64 hist[AGG_SLOTS];	/* latency: slot = floor(log2(ns)), 0 and 1 in 0 */
};

/* Error returns counted by value (best effort: "errors" is exact). */
struct agg_err_key {
	__u32 func;
	__u32 tid;		/* 0 unless per-thread */
	__s64 ret;		/* as the rule reads it: (int)ax for NONZERO32 */
};

#endif /* __GF_AGGREGATE_H */
