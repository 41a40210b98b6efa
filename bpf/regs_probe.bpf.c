// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Capability probes: does this kernel's verifier let a uprobe program write
 * pt_regs (gf_regs_probe)? May it write user memory (gf_write_probe)? The
 * controller tries to load each once; success means `fail` can use the regs
 * mechanism, `corrupt` BPF itself. Those two are never attached.
 * gf_multi_probe counts hits: attached through a uprobe_multi link with a
 * pid filter, it tells whether the kernel has such links and whether the
 * filter takes every thread of the process (6.6-6.10 kernels without the
 * fix matched the main thread only).
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

struct gf_regs_probe {
	__u64 r15, r14, r13, r12, bp, bx, r11, r10, r9, r8;
	__u64 ax, cx, dx, si, di, orig_ax, ip, cs, flags, sp, ss;
};

SEC("uprobe")
int gf_regs_probe(struct gf_regs_probe *ctx)
{
	ctx->ax = 0;
	return 0;
}

/* Second probe: may BPF write user memory (kernel lockdown forbids it)? */
SEC("uprobe")
int gf_write_probe(struct gf_regs_probe *ctx)
{
	__u64 v = 0;

	bpf_probe_write_user((void *)ctx->sp, &v, 1);
	return 0;
}

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} multi_hits SEC(".maps");

SEC("uprobe")
int gf_multi_probe(void *ctx)
{
	__u32 k = 0;
	__u64 *v = bpf_map_lookup_elem(&multi_hits, &k);

	if (v)
		__sync_fetch_and_add(v, 1);
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
