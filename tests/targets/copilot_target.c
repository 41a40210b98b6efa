// SPDX-License-Identifier: GPL-2.0-only
/*
 * Test target for the ptrace copilot (tests/test_copilot*.py, bench/).
 *
 * Its threads raise the copilot's signal themselves, so the ptrace side is
 * tested without the BPF engine: victim_skip() first clobbers the
 * callee-saved registers (the caller's values survive only if the copilot
 * restores them from the injection), then tgkill()s its own thread with
 * the signal, keeping the entry stack pointer. Its body (which sets
 * body_ran and returns BODY_RET) runs only when nothing is injected.
 * victim_after() runs its body first and raises the signal at its return
 * site; its own result is tgkill's 0.
 *
 * usage: copilot_target [--signo N] [--handle] [--no-supervise]
 * Without --no-supervise the program forks: the parent waits for the
 * target (the child) and prints "status exited=N" or "status signaled=N",
 * because the copilot, not the test, is the target's tracer.
 * Line commands on stdin, one tagged line per reply on stdout (a call's
 * line ends with at=CLOCK_MONOTONIC ns just after it returned):
 *   skip | after           call once on the main thread
 *   thread skip|after      call once on a new thread ("begin" then "end")
 *   loop N                 N timed skip calls: "loop bad=B ns..."
 *   workers N | counters   N spinning threads; print their counts
 *   fork                   a child calls skip (untraced), exits 0 if the body ran
 *   exec                   a new thread execs this program (--no-supervise)
 *   sigs                   counts of handled SIGUSR1 and (--handle) the signal
 *   exit N                 exit_group(N) from a new thread
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BODY_RET 1000
#define MAX_WORKERS 16

int g_signo = SIGURG;
__thread int g_body_ran __attribute__((tls_model("local-exec")));
__thread int g_regs_ok __attribute__((tls_model("local-exec")));

long call_skip(void);
long call_after(void);

/* Callee-saved patterns; the tests know them too (CALLEE_SAVED). */
#define PATTERNS \
	"movabs $0x1515151515151515, %r15\n" \
	"movabs $0x1414141414141414, %r14\n" \
	"movabs $0x1313131313131313, %r13\n" \
	"movabs $0x1212121212121212, %r12\n" \
	"movabs $0x0b0b0b0b0b0b0b0b, %rbp\n" \
	"movabs $0x0a0a0a0a0a0a0a0a, %rbx\n"

#define RAISE /* tgkill(getpid(), gettid(), g_signo); clobbers caller-saved only */ \
	"mov $39, %eax\n syscall\n mov %rax, %rdi\n" \
	"mov $186, %eax\n syscall\n mov %rax, %rsi\n" \
	"mov g_signo(%rip), %edx\n mov $234, %eax\n syscall\n"

/* harness(fn): set the patterns, call fn, record whether they survived. */
#define HARNESS(name, fn) \
	".globl " #name "\n" #name ":\n" \
	"push %rbx\n push %rbp\n push %r12\n push %r13\n push %r14\n push %r15\n sub $8, %rsp\n" \
	PATTERNS \
	"call " #fn "\n" \
	"movl $0, %fs:g_regs_ok@tpoff\n" \
	"movabs $0x1515151515151515, %rcx\n cmp %rcx, %r15\n jne 1f\n" \
	"movabs $0x1414141414141414, %rcx\n cmp %rcx, %r14\n jne 1f\n" \
	"movabs $0x1313131313131313, %rcx\n cmp %rcx, %r13\n jne 1f\n" \
	"movabs $0x1212121212121212, %rcx\n cmp %rcx, %r12\n jne 1f\n" \
	"movabs $0x0b0b0b0b0b0b0b0b, %rcx\n cmp %rcx, %rbp\n jne 1f\n" \
	"movabs $0x0a0a0a0a0a0a0a0a, %rcx\n cmp %rcx, %rbx\n jne 1f\n" \
	"movl $1, %fs:g_regs_ok@tpoff\n" \
	"1: add $8, %rsp\n pop %r15\n pop %r14\n pop %r13\n pop %r12\n pop %rbp\n pop %rbx\n ret\n"

__asm__(".text\n"
	".globl victim_skip\nvictim_skip:\n"
	/* clobber what a real prologue would save: only a restore brings them back */
	"xor %ebx, %ebx\n xor %ebp, %ebp\n xor %r12d, %r12d\n"
	"xor %r13d, %r13d\n xor %r14d, %r14d\n xor %r15d, %r15d\n"
	RAISE
	/* the body: runs only when nothing was injected */
	"movl $1, %fs:g_body_ran@tpoff\n"
	PATTERNS
	"mov $1000, %eax\n ret\n"
	".globl victim_after\nvictim_after:\n"
	"movl $1, %fs:g_body_ran@tpoff\n"
	RAISE
	"ret\n"
	HARNESS(call_skip, victim_skip)
	HARNESS(call_after, victim_after));

static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;
static volatile unsigned long counters[MAX_WORKERS * 8]; /* one cache line each */
static int nworkers;
static volatile long usr1_count, sig_count;
static char **g_argv;

static void say(const char *fmt, ...)
{
	char buf[65536];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(buf, sizeof(buf) - 1, fmt, ap);
	va_end(ap);
	if (n > (int)sizeof(buf) - 2)
		n = sizeof(buf) - 2;
	buf[n++] = '\n';
	pthread_mutex_lock(&out_lock);
	if (write(1, buf, n) != n)
		_exit(99);
	pthread_mutex_unlock(&out_lock);
}

static long now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* One call; returns its result and fills body/regs_ok/elapsed ns. */
static long timed_call(int after, int *body, int *regs_ok, long *ns)
{
	long t0, r;

	g_body_ran = 0;
	t0 = now_ns();
	r = after ? call_after() : call_skip();
	*ns = now_ns() - t0;
	*body = g_body_ran;
	*regs_ok = g_regs_ok;
	return r;
}

static void report(const char *tag, int after)
{
	int body, ok;
	long ns, r = timed_call(after, &body, &ok, &ns);

	say("%s ret=%ld body=%d regs=%d ns=%ld tid=%ld at=%ld", tag, r, body, ok, ns,
	    (long)syscall(SYS_gettid), now_ns());
}

static void *caller_thread(void *arg)
{
	say("begin tid=%ld", (long)syscall(SYS_gettid));
	report("end", arg != NULL);
	return NULL;
}

static void *worker(void *arg)
{
	volatile unsigned long *c = arg;

	for (;;)
		(*c)++;
	return NULL;
}

static void *exit_thread(void *arg)
{
	exit((int)(long)arg);
}

static void *exec_thread(void *arg)
{
	char signo[16];
	char *argv[] = { g_argv[0], "--no-supervise", "--signo", signo, NULL };

	(void)arg;
	snprintf(signo, sizeof(signo), "%d", g_signo);
	execv("/proc/self/exe", argv);
	say("error exec failed");
	return NULL;
}

static void spawn(void *(*fn)(void *), void *arg)
{
	pthread_t t;

	if (pthread_create(&t, NULL, fn, arg))
		say("error pthread_create");
	pthread_detach(t);
}

static void on_usr1(int sig) { (void)sig; usr1_count++; }
static void on_sig(int sig) { (void)sig; sig_count++; }

static void do_loop(int n)
{
	static char buf[60000];
	int len = 0, bad = 0, body, ok;
	long ns;

	for (int i = 0; i < n && len < (int)sizeof(buf) - 32; i++) {
		long r = timed_call(0, &body, &ok, &ns);

		bad += (r != BODY_RET || !body || !ok);
		len += snprintf(buf + len, sizeof(buf) - len, " %ld", ns);
	}
	say("loop bad=%d%s", bad, buf);
}

static void do_fork(void)
{
	int st, body, ok;
	long ns;
	pid_t c = fork();

	if (c == 0) {
		long r = timed_call(0, &body, &ok, &ns);

		_exit(r == BODY_RET && body && ok ? 0 : 1);
	}
	waitpid(c, &st, 0);
	say("fork child=%d exited=%d code=%d", c, WIFEXITED(st), WEXITSTATUS(st));
}

static void supervise(void)
{
	int st;
	pid_t c = fork();

	if (c == 0)
		return;
	while (waitpid(c, &st, 0) < 0)
		;
	if (WIFEXITED(st))
		say("status exited=%d", WEXITSTATUS(st));
	else
		say("status signaled=%d", WTERMSIG(st));
	exit(0);
}

int main(int argc, char **argv)
{
	char line[256];
	int supervised = 1, handle = 0;

	g_argv = argv;
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--signo") && i + 1 < argc)
			g_signo = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--handle"))
			handle = 1;
		else if (!strcmp(argv[i], "--no-supervise"))
			supervised = 0;
	}
	if (supervised)
		supervise();
	signal(SIGUSR1, on_usr1);
	if (handle)
		signal(g_signo, on_sig);
	say("ready pid=%d", getpid());
	while (fgets(line, sizeof(line), stdin)) {
		int n = 0;

		if (!strcmp(line, "skip\n"))
			report("skip", 0);
		else if (!strcmp(line, "after\n"))
			report("after", 1);
		else if (!strcmp(line, "thread skip\n"))
			spawn(caller_thread, NULL);
		else if (!strcmp(line, "thread after\n"))
			spawn(caller_thread, (void *)1);
		else if (sscanf(line, "loop %d", &n) == 1)
			do_loop(n);
		else if (sscanf(line, "workers %d", &n) == 1) {
			for (int i = 0; i < n && nworkers < MAX_WORKERS; i++, nworkers++)
				spawn(worker, (void *)&counters[nworkers * 8]);
			say("workers n=%d", nworkers);
		} else if (!strcmp(line, "counters\n")) {
			char buf[1024];
			int len = 0;

			for (int i = 0; i < nworkers; i++)
				len += snprintf(buf + len, sizeof(buf) - len, " %lu", counters[i * 8]);
			buf[len] = 0;
			say("counters%s", buf);
		} else if (!strcmp(line, "fork\n"))
			do_fork();
		else if (!strcmp(line, "exec\n"))
			spawn(exec_thread, NULL);
		else if (!strcmp(line, "sigs\n"))
			say("sigs usr1=%ld sig=%ld", usr1_count, sig_count);
		else if (sscanf(line, "exit %d", &n) == 1)
			spawn(exit_thread, (void *)(long)n);
		else
			say("error unknown command");
	}
	return 0;
}
