/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The state gfsig.so keeps and the controller writes and reads through
 * /proc/PID/mem (pyctl/fastpath/inject.py mirrors it; tests/test_fastpath.py
 * checks the mirror against this header).
 */
#ifndef GFSIG_H
#define GFSIG_H

#include <stdint.h>

#define GFSIG_MAGIC 0x3130304749534647ull /* "GFSIG001" */
#define GFSIG_MAX_SITES 256

enum gfsig_kind {
	GFSIG_FAIL = 0,		/* return at once with retval (skip) */
	GFSIG_STALL = 1,	/* wait stall_ns (or to the deadline), then run on */
};

struct gfsig_site {
	uint64_t rip_after;	/* probe site + length of its first insn */
	int64_t sp_delta;	/* entry sp = rsp at the signal + this */
	int64_t retval;
	int32_t err;		/* errno to set, 0: leave errno */
	uint32_t kind;		/* enum gfsig_kind */
	uint64_t stall_ns;
};

struct gfsig_state {
	uint64_t magic;
	uint32_t armed;		/* 1 between gfsig_arm and gfsig_disarm */
	uint32_t signo;
	uint64_t deadline_ns;	/* CLOCK_MONOTONIC; 0: none. Inert after it */
	uint32_t nsites;
	uint32_t release_gen;	/* bumped by gfsig_disarm: stalls end at once */
	uint64_t handled;	/* injections carried out */
	uint64_t inert;		/* kernel-sent at a site, but disarmed/expired */
	uint64_t foreign;	/* other senders' signals, passed on */
	uint64_t stray;		/* kernel-sent at no site (a fire delivered late) */
	struct gfsig_site sites[GFSIG_MAX_SITES];
};

#endif
