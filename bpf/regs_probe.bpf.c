// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * Capability probes: does this kernel's verifier let a uprobe program write
 * pt_regs (gf_regs_probe)? May it write user memory (gf_write_probe)? The controller tries to load this object once; success means
 * `fail` can use the regs mechanism. Never attached.
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

char LICENSE[] SEC("license") = "Dual BSD/GPL";
