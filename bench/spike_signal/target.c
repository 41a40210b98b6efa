// Spike target: gf_spike_victim() starts with `push %rbp`; a SIGURG handler
// carries out "skip, return -5" when the signal comes from the kernel
// (si_code SI_KERNEL: bpf_send_signal_thread / bpf_send_signal_task).
// Usage: target MODE(plain|value) THREADS N; waits for a line on stdin,
// then each thread makes N timed calls; prints the distribution.
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

static int mode_value;
static volatile long handled, foreign;

long gf_spike_victim(long x);
__asm__(".text\n.globl gf_spike_victim\n.type gf_spike_victim,@function\n"
	"gf_spike_victim:\n\tpush %rbp\n\tmov %rsp,%rbp\n"
	"\tlea 1000(%rdi),%rax\n\tpop %rbp\n\tret\n"
	".size gf_spike_victim,.-gf_spike_victim\n");

static void handler(int sig, siginfo_t *si, void *uc_)
{
	ucontext_t *uc = uc_;
	greg_t *g = uc->uc_mcontext.gregs;
	uint64_t entry_sp;

	(void)sig;
	if (si->si_code != SI_KERNEL) {
		__atomic_add_fetch(&foreign, 1, __ATOMIC_RELAXED);
		return;
	}
	if (mode_value)
		entry_sp = (uint64_t)si->si_value.sival_ptr;
	else	/* the probed `push %rbp` has run: sp is 8 below entry */
		entry_sp = (uint64_t)g[REG_RSP] + 8;
	g[REG_RIP] = *(uint64_t *)entry_sp;
	g[REG_RSP] = entry_sp + 8;
	g[REG_RAX] = -5;
	__atomic_add_fetch(&handled, 1, __ATOMIC_RELAXED);
}

static long n_calls;
static uint64_t *lat;
static volatile long failed;

static uint64_t now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

static void *worker(void *arg)
{
	uint64_t *l = lat + (long)arg * n_calls;
	for (long i = 0; i < n_calls; i++) {
		uint64_t t0 = now();
		long r = gf_spike_victim(i);
		l[i] = now() - t0;
		if (r == -5)
			__atomic_add_fetch(&failed, 1, __ATOMIC_RELAXED);
		else if (r != i + 1000)
			abort();
	}
	return NULL;
}

static int cmp(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	if (argc != 4)
		return 2;
	mode_value = !strcmp(argv[1], "value");
	int nt = atoi(argv[2]);
	n_calls = atol(argv[3]);
	struct sigaction sa = {.sa_sigaction = handler, .sa_flags = SA_SIGINFO | SA_RESTART};
	sigemptyset(&sa.sa_mask);
	sigaction(SIGURG, &sa, NULL);
	lat = calloc(nt * n_calls, sizeof(*lat));
	printf("ready %d\n", getpid());
	fflush(stdout);
	char line[64];
	if (!fgets(line, sizeof line, stdin))
		return 1;
	pthread_t th[64];
	for (long t = 0; t < nt; t++)
		pthread_create(&th[t], NULL, worker, (void *)t);
	for (int t = 0; t < nt; t++)
		pthread_join(th[t], NULL);
	long n = nt * n_calls;
	qsort(lat, n, sizeof(*lat), cmp);
	printf("n=%ld p50=%lu p99=%lu max=%lu failed=%ld handled=%ld foreign=%ld\n", n,
	       lat[n / 2], lat[n * 99 / 100], lat[n - 1], failed, handled, foreign);
	return 0;
}
