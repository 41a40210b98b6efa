// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/*
 * gfsig.so: gpufault's in-target helper for the "signal" mechanism
 * (issue 26, docs/copilot.md "The signal fast path").
 *
 * The controller loads it into a running process once (a ptrace-driven
 * dlopen of a sealed memfd, pyctl/fastpath/inject.py), writes the probe
 * sites into gfsig_state through /proc/PID/mem, then calls gfsig_arm(sig).
 * Each fire of a fail-skip spec is bpf_send_signal_thread(sig) from the
 * entry uprobe; the kernel delivers it before the thread runs another user
 * instruction, with the probed first instruction already emulated or
 * single-stepped. The handler finds the site by rip (= site + that
 * instruction's length), recomputes the entry sp (rsp + the instruction's
 * stack delta, which the controller decoded), and edits the saved context:
 * rip = *(u64 *)entry_sp, rsp = entry_sp + 8, rax = retval, errno if asked.
 * One instruction cannot have clobbered a callee-saved register without
 * saving it first, so those are the entry's already.
 *
 * Only signals the kernel sent (si_code SI_KERNEL) at a known site are
 * injections; any other delivery of the signal is passed on to the action
 * the target had (which gfsig_arm requires to be SIG_DFL or SIG_IGN, and
 * the signal one that is ignored by default). gfsig_disarm restores that
 * action. No dependencies beyond libc; async-signal-safe only.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include "gfsig.h"

__attribute__((visibility("default"))) struct gfsig_state gfsig_state = {
	.magic = GFSIG_MAGIC,
};
static struct sigaction old_action;

static void pass_on(int sig, siginfo_t *si, void *uc)
{
	__atomic_add_fetch(&gfsig_state.foreign, 1, __ATOMIC_RELAXED);
	/* gfsig_arm took only SIG_DFL/SIG_IGN of a default-ignored signal. */
	(void)sig, (void)si, (void)uc;
}

static uint64_t mono_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

/* Hold this thread until stall_ns from now, the run's deadline, or
 * gfsig_disarm, whichever comes first: on the clock, so the end holds
 * whatever happens to the controller. */
static void stall(const struct gfsig_site *s)
{
	uint32_t gen = __atomic_load_n(&gfsig_state.release_gen, __ATOMIC_ACQUIRE);
	uint64_t end = mono_ns() + s->stall_ns;
	struct timespec abs;

	if (gfsig_state.deadline_ns && end > gfsig_state.deadline_ns)
		end = gfsig_state.deadline_ns;
	abs.tv_sec = end / 1000000000ull;
	abs.tv_nsec = end % 1000000000ull;
	while (mono_ns() < end &&
	       __atomic_load_n(&gfsig_state.release_gen, __ATOMIC_ACQUIRE) == gen)
		syscall(SYS_futex, &gfsig_state.release_gen, FUTEX_WAIT_BITSET_PRIVATE, gen,
			&abs, NULL, FUTEX_BITSET_MATCH_ANY);
}

static void handler(int sig, siginfo_t *si, void *ucv)
{
	ucontext_t *uc = ucv;
	greg_t *g = uc->uc_mcontext.gregs;
	struct gfsig_site *s = 0;
	uint64_t entry_sp;
	uint32_t i, n;
	int saved_errno = errno;	/* the interrupted code's, kept unless asked */

	if (si->si_code != SI_KERNEL) {
		pass_on(sig, si, ucv);
		return;
	}
	n = __atomic_load_n(&gfsig_state.nsites, __ATOMIC_ACQUIRE);
	if (n > GFSIG_MAX_SITES)
		n = GFSIG_MAX_SITES;
	for (i = 0; i < n; i++) {
		if (gfsig_state.sites[i].rip_after == (uint64_t)g[REG_RIP]) {
			s = &gfsig_state.sites[i];
			break;
		}
	}
	if (!s) {	/* BPF's, but the thread is elsewhere: blocked till now? */
		__atomic_add_fetch(&gfsig_state.stray, 1, __ATOMIC_RELAXED);
		return;
	}
	if (!__atomic_load_n(&gfsig_state.armed, __ATOMIC_ACQUIRE)) {
		__atomic_add_fetch(&gfsig_state.inert, 1, __ATOMIC_RELAXED);
		return;
	}
	if (gfsig_state.deadline_ns && mono_ns() >= gfsig_state.deadline_ns) {
		__atomic_add_fetch(&gfsig_state.inert, 1, __ATOMIC_RELAXED);
		return;
	}
	if (s->kind == GFSIG_STALL) {
		__atomic_add_fetch(&gfsig_state.handled, 1, __ATOMIC_RELAXED);
		stall(s);
		errno = saved_errno;
		return;	/* the call runs on, its registers untouched */
	}
	entry_sp = (uint64_t)g[REG_RSP] + s->sp_delta;
	g[REG_RIP] = *(uint64_t *)entry_sp;
	g[REG_RSP] = entry_sp + 8;
	g[REG_RAX] = s->retval;
	errno = s->err ? s->err : saved_errno;
	__atomic_add_fetch(&gfsig_state.handled, 1, __ATOMIC_RELAXED);
}

/* Install the handler for signo. 0, or -errno: -EBUSY when the target
 * has its own handler there (then the controller picks the copilot). */
__attribute__((visibility("default"))) int gfsig_arm(int signo)
{
	struct sigaction sa, cur;

	if (signo != SIGURG && signo != SIGWINCH)
		return -EINVAL;	/* only signals whose default is to ignore */
	if (gfsig_state.armed)
		return -EALREADY;
	if (sigaction(signo, NULL, &cur))
		return -errno;
	if ((cur.sa_flags & SA_SIGINFO) ||
	    (cur.sa_handler != SIG_DFL && cur.sa_handler != SIG_IGN))
		return -EBUSY;
	memset(&sa, 0, sizeof(sa));
	sa.sa_sigaction = handler;
	sa.sa_flags = SA_SIGINFO | SA_RESTART;
	sigemptyset(&sa.sa_mask);
	old_action = cur;
	gfsig_state.signo = signo;
	if (sigaction(signo, &sa, NULL))
		return -errno;
	__atomic_store_n(&gfsig_state.armed, 1, __ATOMIC_RELEASE);
	return 0;
}

/* Restore the target's own action; the handler is gone, the helper inert. */
__attribute__((visibility("default"))) int gfsig_disarm(void)
{
	if (!gfsig_state.armed)
		return 0;
	__atomic_store_n(&gfsig_state.armed, 0, __ATOMIC_RELEASE);
	/* Stalls in progress end now: the controller is detaching. */
	__atomic_add_fetch(&gfsig_state.release_gen, 1, __ATOMIC_RELEASE);
	syscall(SYS_futex, &gfsig_state.release_gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
	if (sigaction(gfsig_state.signo, &old_action, NULL))
		return -errno;
	return 0;
}
