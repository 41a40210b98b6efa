// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* The floor for probe-cost benchmarks: a uprobe program that does nothing. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

SEC("uprobe")
int gf_bench_empty(void *ctx)
{
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
