// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * netchaos's drop filter (pyctl/netchaos.py): a tc classifier on a veth
 * end's clsact egress, direct action. It drops a share of the packets that
 * leave (loss where the kernel lacks sch_netem, and partitions: every
 * packet but ARP, so neighbour resolution keeps working).
 *
 * The share and the deadline live in the one-entry array map
 * netchaos_state, so a change is one map write. The deadline is the
 * kernel's own, as for every other gpufault fault (gpufault.bpf.c): past
 * deadline_ns (CLOCK_MONOTONIC, bpf_ktime_get_ns) the filter passes every
 * packet, so a window ends on time even when its controller was SIGKILLed
 * and nothing in user space is left to lift it. 0: no deadline (until the
 * controller or its watchdog removes the filter).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

struct netchaos_state {
	__u64 threshold;	/* drop when prandom_u32 < threshold; 2^32: all */
	__u64 drops;		/* packets dropped */
	__u64 seen;		/* packets looked at (ARP excepted) */
	__u64 deadline_ns;	/* pass everything from then on; 0: none */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct netchaos_state);
} netchaos_state SEC(".maps");

SEC("tc")
int netchaos_drop(struct __sk_buff *skb)
{
	struct netchaos_state *s;
	__u32 key = 0;

	if (skb->protocol == bpf_htons(ETH_P_ARP))
		return TC_ACT_OK;
	s = bpf_map_lookup_elem(&netchaos_state, &key);
	if (!s)
		return TC_ACT_OK;
	__sync_fetch_and_add(&s->seen, 1);
	if (s->deadline_ns && bpf_ktime_get_ns() >= s->deadline_ns)
		return TC_ACT_OK;
	if (s->threshold && bpf_get_prandom_u32() < s->threshold) {
		__sync_fetch_and_add(&s->drops, 1);
		return TC_ACT_SHOT;
	}
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "GPL";
