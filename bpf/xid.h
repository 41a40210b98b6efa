/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The Xid record shared by xid.bpf.c and the Python controller
 * (pyctl/xid.py EVENT_FMT mirrors it; tests/test_xid.py compiles a C
 * program against this header and compares sizes and offsets).
 *
 * Plain C with fixed-width types only: no vmlinux.h, no kernel headers.
 */
#ifndef __GF_XID_H
#define __GF_XID_H

#define XID_DEV_LEN 32
#define XID_MSG_LEN 128

struct xid_event {
	__u64 ts_ns;		/* CLOCK_MONOTONIC, as the engine's fault rows */
	__u64 error_code;
	__u32 pid;		/* whoever was on the CPU when the driver logged */
	__u32 tid;
	char dev[XID_DEV_LEN];
	char msg[XID_MSG_LEN];
};

#endif /* __GF_XID_H */
