// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Records the NVIDIA driver's Xid tracepoint (nvidia:nvidia_dev_xid: dev,
 * error_code, msg) into a ring buffer, in one of two ways:
 *
 * gf_xid_raw: a raw tracepoint on the driver's
 *   TP_PROTO(const struct pci_dev *pdev, u32 error_code, const char *msg)
 *   (open-gpu-kernel-modules, nv-tracepoint.h). Attached by name through
 *   bpf(2), so it needs no tracefs; pci_name(pdev) is read with CO-RE
 *   against vmlinux's struct pci_dev (the driver itself has no BTF).
 * gf_xid: a classic tracepoint whose record layout comes from its
 *   `format` file at run time (the controller, pyctl/xid.py, writes each
 *   field's offset, size and whether it is a __data_loc string into
 *   .rodata before load). This needs tracefs; it is the fallback for a
 *   kernel that refuses the raw attach, and it can be attached to any
 *   tracepoint with a string and an integer field (the host tests use one
 *   of the kernel's own, since no NVIDIA driver runs there).
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#include "xid.h"

/* Layout of the tracepoint record, filled from its format file. */
const volatile __u32 off_dev = 0;
const volatile __u32 dev_loc = 1;	/* 1: __data_loc char[]; 0: inline char[] */
const volatile __u32 off_code = 0;
const volatile __u32 size_code = 4;	/* 1, 2, 4 or 8 bytes */
const volatile __u32 off_msg = 0;
const volatile __u32 msg_loc = 1;
const volatile __u32 has_msg = 1;

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 * 1024);
} xids SEC(".maps");

/* Events lost to a full ring: key 0. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} xid_lost SEC(".maps");

/* Copy a string field: a __data_loc word is (length << 16 | offset). */
static __always_inline void read_str(void *ctx, __u32 off, __u32 loc, char *dst, __u32 len)
{
	__u32 where = off;

	if (loc) {
		__u32 word = 0;

		bpf_probe_read_kernel(&word, sizeof(word), ctx + off);
		where = word & 0xffff;
	}
	bpf_probe_read_kernel_str(dst, len, ctx + where);
}

/* Reserve first: a full ring costs one counter bump, nothing else. */
static __always_inline struct xid_event *reserve_xid(void)
{
	struct xid_event *e = bpf_ringbuf_reserve(&xids, sizeof(*e), 0);
	__u64 id;

	if (!e) {
		__u32 k = 0;
		__u64 *n = bpf_map_lookup_elem(&xid_lost, &k);

		if (n)
			__sync_fetch_and_add(n, 1);
		return 0;
	}
	e->ts_ns = bpf_ktime_get_ns();
	id = bpf_get_current_pid_tgid();
	e->pid = id >> 32;
	e->tid = (__u32)id;
	return e;
}

SEC("tracepoint/nvidia/nvidia_dev_xid")
int gf_xid(void *ctx)
{
	struct xid_event *e;
	__u64 code = 0;

	e = reserve_xid();
	if (!e)
		return 0;
	/* Little endian: reading size_code bytes into the low end is exact;
	 * constant sizes keep the verifier's bounds simple. */
	if (size_code == 8)
		bpf_probe_read_kernel(&code, 8, ctx + off_code);
	else if (size_code == 2)
		bpf_probe_read_kernel(&code, 2, ctx + off_code);
	else if (size_code == 1)
		bpf_probe_read_kernel(&code, 1, ctx + off_code);
	else
		bpf_probe_read_kernel(&code, 4, ctx + off_code);
	e->error_code = code;
	e->dev[0] = 0;
	e->msg[0] = 0;
	read_str(ctx, off_dev, dev_loc, e->dev, sizeof(e->dev));
	if (has_msg)
		read_str(ctx, off_msg, msg_loc, e->msg, sizeof(e->msg));
	bpf_ringbuf_submit(e, 0);
	return 0;
}

struct kobject {
	const char *name;
} __attribute__((preserve_access_index));

struct device {
	struct kobject kobj;
	const char *init_name;
} __attribute__((preserve_access_index));

struct pci_dev {
	struct device dev;
} __attribute__((preserve_access_index));

/* dev_name(): init_name until the device is added, then the kobject's. */
static __always_inline const char *pci_name_of(const struct pci_dev *pdev)
{
	const char *name = BPF_CORE_READ(pdev, dev.init_name);

	return name ? name : BPF_CORE_READ(pdev, dev.kobj.name);
}

SEC("raw_tp/nvidia_dev_xid")
int gf_xid_raw(__u64 *ctx)
{
	const struct pci_dev *pdev = (const void *)ctx[0];
	const char *msg = (const void *)ctx[2];
	const char *name;
	struct xid_event *e;

	e = reserve_xid();
	if (!e)
		return 0;
	e->error_code = (__u32)ctx[1];
	e->dev[0] = 0;
	e->msg[0] = 0;
	name = pdev ? pci_name_of(pdev) : 0;
	if (name)
		bpf_probe_read_kernel_str(e->dev, sizeof(e->dev), name);
	if (msg)
		bpf_probe_read_kernel_str(e->msg, sizeof(e->msg), msg);
	bpf_ringbuf_submit(e, 0);
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
