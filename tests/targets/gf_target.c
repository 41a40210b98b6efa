// SPDX-License-Identifier: GPL-2.0
/*
 * Test target: reads commands from stdin, one per line, so tests attach
 * first and then drive calls (no sleeps as synchronization).
 *   victim N T   - T threads each call gf_victim N times; prints per-thread
 *                  lines "t=<idx> tid=<tid> i=<k> ret=<r> out=<o>"
 *   alloc N      - gf_alloc N times, prints "alloc i=<k> ret=<r> ptr=<p>"
 *   empty N      - gf_empty N times (benchmarks), prints "ns_per_call=<x>"
 *   pace N R     - gf_empty N times at R calls per second (busy-paced),
 *                  prints "ns_per_call=<x>"
 *   timed N      - gf_victim N times, each call timed with CLOCK_MONOTONIC;
 *                  prints "timed n=<N> p50=<ns> p99=<ns> max=<ns> failed=<k>"
 *   both N       - main thread: gf_alloc then gf_victim, N times, prints
 *                  "both i=<k> alloc=<r> victim=<r>"
 *   read N       - read(2) 1 byte from /dev/zero N times, called from this
 *                  program itself; prints "read n=<N> failed=<k>"
 *   quit         - exit 0
 * Prints "ready pid=<pid>" at start and "done" after each command.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

long gf_victim(long a, long *out);
int gf_alloc(uint64_t *dptr, uint64_t size);
long gf_empty(long a);

struct job { int idx; long n; };
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;
static int quiet;

static void *run_victim(void *arg)
{
	struct job *j = arg;
	long tid = syscall(SYS_gettid);

	for (long i = 1; i <= j->n; i++) {
		long out = -1;
		long r = gf_victim(i, &out);

		if (!quiet || r != i + 1 || out != 2 * i) {
			pthread_mutex_lock(&out_lock);
			printf("t=%d tid=%ld i=%ld ret=%ld out=%ld\n", j->idx, tid, i, r, out);
			pthread_mutex_unlock(&out_lock);
		}
	}
	return NULL;
}

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return (x > y) - (x < y);
}

static double now_ns(void);

static void timed(long n)
{
	double *d = calloc(n, sizeof(*d));
	long failed = 0;

	if (!d)
		return;
	for (long i = 0; i < n; i++) {
		long out;
		double t0 = now_ns();
		long r = gf_victim(i, &out);

		d[i] = now_ns() - t0;
		failed += r != i + 1;
	}
	qsort(d, n, sizeof(*d), cmp_double);
	printf("timed n=%ld p50=%.0f p99=%.0f max=%.0f failed=%ld\n", n, d[n / 2],
	       d[(long)(n * 0.99)], d[n - 1], failed);
	free(d);
}

static double now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(void)
{
	char line[256];

	setvbuf(stdout, NULL, _IOLBF, 0);
	printf("ready pid=%d\n", getpid());
	while (fgets(line, sizeof(line), stdin)) {
		long n = 0, t = 1;

		if (sscanf(line, "victim %ld %ld", &n, &t) >= 1 ||
		    sscanf(line, "quiet %ld %ld", &n, &t) >= 1) {
			pthread_t th[64];
			struct job jobs[64];

			quiet = line[0] == 'q';
			if (t < 1 || t > 64)
				t = 1;
			for (int i = 0; i < t; i++) {
				jobs[i].idx = i;
				jobs[i].n = n;
				pthread_create(&th[i], NULL, run_victim, &jobs[i]);
			}
			for (int i = 0; i < t; i++)
				pthread_join(th[i], NULL);
		} else if (sscanf(line, "read %ld", &n) == 1) {
			/* read() called from here, while fgets() above reaches
			 * read() from inside libc: the --caller filter tells them
			 * apart. */
			int fd = open("/dev/zero", O_RDONLY);
			long failed = 0;
			char c;

			for (long i = 0; i < n; i++)
				if (read(fd, &c, 1) != 1)
					failed++;
			close(fd);
			printf("read n=%ld failed=%ld\n", n, failed);
		} else if (sscanf(line, "alloc %ld", &n) == 1) {
			for (long i = 1; i <= n; i++) {
				uint64_t p = 0;
				int r = gf_alloc(&p, 4096 * i);

				printf("alloc i=%ld ret=%d ptr=%#lx\n", i, r, (unsigned long)p);
			}
		} else if (sscanf(line, "timed %ld", &n) == 1 && n > 0) {
			timed(n);
		} else if (sscanf(line, "both %ld", &n) == 1) {
			for (long i = 1; i <= n; i++) {
				uint64_t p = 0;
				long out;
				int r = gf_alloc(&p, 4096);
				long v = gf_victim(i, &out);

				printf("both i=%ld alloc=%d victim=%ld\n", i, r, v);
			}
		} else if (sscanf(line, "pace %ld %ld", &n, &t) == 2) {
			double t0 = now_ns(), gap = 1e9 / (t > 0 ? t : 1);
			long acc = 0;

			for (long i = 0; i < n; i++) {
				while (now_ns() - t0 < i * gap)
					;
				acc += gf_empty(i);
			}
			printf("ns_per_call=%.2f acc=%ld\n", (now_ns() - t0) / n, acc);
		} else if (sscanf(line, "empty %ld", &n) == 1) {
			double t0 = now_ns();
			long acc = 0;

			for (long i = 0; i < n; i++)
				acc += gf_empty(i);
			printf("ns_per_call=%.2f acc=%ld\n", (now_ns() - t0) / n, acc);
		} else if (!strncmp(line, "quit", 4)) {
			return 0;
		}
		printf("done\n");
	}
	return 0;
}
