// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* Spike (issue 26): a uprobe that asks the faulting thread's own signal
 * handler to carry out a fail. Two ways to reach the handler:
 *  - spike_plain: bpf_send_signal_thread(sig); the handler recomputes the
 *    entry sp from its ucontext (the probed first instruction is known).
 *  - spike_value: the bpf_send_signal_task kfunc (6.13+) with the entry sp
 *    as si_value, if the verifier allows it in a uprobe program. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

struct gf_regs {
	__u64 r15, r14, r13, r12, bp, bx, r11, r10, r9, r8;
	__u64 ax, cx, dx, si, di, orig_ax, ip, cs, flags, sp, ss;
};
struct task_struct { int pid; } __attribute__((preserve_access_index));
enum pid_type { PIDTYPE_PID };
extern int bpf_send_signal_task(struct task_struct *task, int sig, enum pid_type type,
				__u64 value) __ksym __weak;

const volatile __u32 tgid = 0;
const volatile __u32 signo = 23;
__u64 fired = 0;

SEC("uprobe")
int spike_plain(struct gf_regs *ctx)
{
	if ((bpf_get_current_pid_tgid() >> 32) != tgid)
		return 0;
	__sync_fetch_and_add(&fired, 1);
	bpf_send_signal_thread(signo);
	return 0;
}

SEC("uprobe")
int spike_value(struct gf_regs *ctx)
{
	if ((bpf_get_current_pid_tgid() >> 32) != tgid)
		return 0;
	__sync_fetch_and_add(&fired, 1);
	bpf_send_signal_task(bpf_get_current_task_btf(), signo, PIDTYPE_PID, ctx->sp);
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
