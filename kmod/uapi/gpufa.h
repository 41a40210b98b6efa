/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * gpufa: the record and ioctl layout of /dev/gpufa.
 *
 * Shared by the kernel module (gpufa.c) and user space; the Python client
 * (pyctl/anchors/uapi.py) mirrors it and a test compares every size and
 * offset. Fixed-width types only, no implicit padding: every field sits at
 * an offset that is a multiple of its size and the record is a multiple of
 * eight bytes, so the layout is the same for every compiler and ABI.
 */
#ifndef _UAPI_GPUFA_H
#define _UAPI_GPUFA_H

#include <linux/ioctl.h>
#include <linux/types.h>

#define GPUFA_ABI_VERSION 1

#define GPUFA_CFG_SIZE 256	/* bytes of PCI config space per record */
#define GPUFA_MAX_BAR0 16	/* BAR0 offsets read per record */
#define GPUFA_AER_REGS 10	/* dwords copied from the AER capability */
#define GPUFA_COMM_LEN 16

/* What produced a record. */
enum gpufa_anchor {
	GPUFA_ANCHOR_RESET_BEGIN = 1,	/* a function reset is about to run */
	GPUFA_ANCHOR_RESET_END = 2,	/* it returned (same fault ID) */
	GPUFA_ANCHOR_GONE = 3,		/* config space or BOOT_0+42 all ones */
	GPUFA_ANCHOR_AER = 4,		/* the kernel reported an AER error */
	GPUFA_ANCHOR_DRIVER = 5,	/* a driver called gpufa_fire() */
	GPUFA_ANCHOR_MANUAL = 6,	/* GPUFA_IOC_FIRE on /dev/gpufa */
};

/* gpufa_record.flags */
#define GPUFA_REC_CTX		(1U << 0)	/* fault ID from the active context */
#define GPUFA_REC_CFG_OK	(1U << 1)	/* config space answered (not ~0) */
#define GPUFA_REC_AER_CAP	(1U << 2)	/* aer[] holds the AER capability */
#define GPUFA_REC_PCIE		(1U << 3)	/* devsta holds PCIe Device Status */

/* aer[] indexes: the AER capability's registers in their order. */
enum gpufa_aer_reg {
	GPUFA_AER_UNCOR_STATUS = 0,
	GPUFA_AER_UNCOR_MASK = 1,
	GPUFA_AER_UNCOR_SEVER = 2,
	GPUFA_AER_COR_STATUS = 3,
	GPUFA_AER_COR_MASK = 4,
	GPUFA_AER_CAP_CTRL = 5,
	GPUFA_AER_HEADER_LOG = 6,	/* four dwords: 6..9 */
};

/*
 * One anchor. read() returns whole records only. The fault ID is
 * (run_id, fault_seq): run_id != 0 when the controller set it through
 * GPUFA_IOC_SET_CTX, 0 when the module made it up (fault_seq then counts
 * the module's own IDs). A reset's begin and end records share one ID.
 */
struct gpufa_record {
	__u16 version;		/* GPUFA_ABI_VERSION */
	__u16 size;		/* sizeof(struct gpufa_record) */
	__u32 kind;		/* enum gpufa_anchor */
	__u64 fault_seq;
	__u32 run_id;
	__u32 flags;		/* GPUFA_REC_* */
	__u64 rec_seq;		/* records made since load, from 1 */
	__u64 mono_ns;		/* CLOCK_MONOTONIC */
	__u64 wall_ns;		/* CLOCK_REALTIME */
	__u32 domain;		/* PCI segment */
	__u8 bus;
	__u8 devfn;		/* slot << 3 | function */
	__u16 vendor;		/* as found at load time */
	__u16 device;
	__u16 devsta;		/* PCIe Device Status */
	__s32 code;		/* gpufa_fire() or GPUFA_IOC_FIRE code */
	__u32 pid;		/* task that triggered the anchor (tgid) */
	__u32 ctx_pid;		/* pid from the fault context, 0 = none */
	char comm[GPUFA_COMM_LEN];	/* its comm */
	__u32 aer_pos;		/* AER capability offset, 0 = none */
	__u32 aer[GPUFA_AER_REGS];
	__u32 bar0_nr;		/* entries used in bar0_off/bar0_val */
	__u32 bar0_ok;		/* bit i: bar0_val[i] was read */
	__u32 bar0_off[GPUFA_MAX_BAR0];
	__u32 bar0_val[GPUFA_MAX_BAR0];	/* GPUFA_BAR0_UNREAD if not read */
	__u32 reserved;		/* 0; keeps config[] and the size 8-aligned */
	__u8 config[GPUFA_CFG_SIZE];
};

/* The value stored where a BAR0 read was impossible (bar0_ok says so). */
#define GPUFA_BAR0_UNREAD 0xffffffffU

/* GPUFA_IOC_SET_CTX: anchors after this carry (run_id, fault_seq). */
struct gpufa_ctx {
	__u64 fault_seq;	/* != 0 */
	__u32 run_id;		/* != 0 */
	__u32 pid;		/* injected process; 0 = the caller's */
};

/* GPUFA_IOC_FIRE and GPUFA_IOC_RESET: a watched device by address. */
struct gpufa_fire {
	__u32 domain;
	__u8 bus;
	__u8 devfn;
	__u16 flags;		/* GPUFA_FIRE_ANY: the first watched device */
	__s32 code;		/* stored in the record */
	__u32 pad;		/* must be 0 */
};

#define GPUFA_FIRE_ANY 1

struct gpufa_stats {
	__u64 records;		/* records made (queued or not) */
	__u64 overflow;		/* records dropped because the fifo was full */
	__u64 nomem;		/* records lost to allocation failure */
	__u64 rp_missed;	/* reset probes the kernel missed */
	__u32 queued;		/* records waiting in the fifo now */
	__u32 capacity;		/* fifo size in records */
	__u32 devices;		/* watched devices */
	__u32 gone;		/* of those, found gone */
	__u32 kprobes;		/* reset probes registered */
	__u32 aer_hooked;	/* 1: the aer_event tracepoint is hooked */
};

#define GPUFA_IOC_MAGIC 'G'
#define GPUFA_IOC_SET_CTX	_IOW(GPUFA_IOC_MAGIC, 1, struct gpufa_ctx)
#define GPUFA_IOC_CLEAR_CTX	_IO(GPUFA_IOC_MAGIC, 2)
#define GPUFA_IOC_FIRE		_IOW(GPUFA_IOC_MAGIC, 3, struct gpufa_fire)
#define GPUFA_IOC_STATS		_IOR(GPUFA_IOC_MAGIC, 4, struct gpufa_stats)
#define GPUFA_IOC_RESET		_IOW(GPUFA_IOC_MAGIC, 5, struct gpufa_fire)

#endif /* _UAPI_GPUFA_H */
