// SPDX-License-Identifier: GPL-2.0
/*
 * Test target for a fail that sets errno: libc calls whose failure the
 * program reports in its own words (strerror(errno)), as an application
 * does. Commands on stdin, one per line (tests attach first):
 *   access N T  - T threads (0: the main thread itself) each call
 *                 access("/", F_OK) N times, errno cleared before each;
 *                 prints "access t=<idx> i=<k> ret=<r> errno=<e> msg=<strerror>"
 *   where       - prints "errno_at tid=<tid> addr=<&errno>" (main thread)
 *   quit        - exit 0
 * Prints "ready pid=<pid>" at start and "done" after each command.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

struct job { int idx; long n; };
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;

static void *run_access(void *arg)
{
	struct job *j = arg;

	for (long i = 1; i <= j->n; i++) {
		int r, e;

		errno = 0;
		r = access("/", F_OK);
		e = errno;
		pthread_mutex_lock(&out_lock);
		printf("access t=%d i=%ld ret=%d errno=%d msg=%s\n", j->idx, i, r, e, strerror(e));
		pthread_mutex_unlock(&out_lock);
	}
	return NULL;
}

int main(void)
{
	char line[256];

	setvbuf(stdout, NULL, _IOLBF, 0);
	printf("ready pid=%d\n", getpid());
	while (fgets(line, sizeof(line), stdin)) {
		long n = 0, t = 0;

		if (sscanf(line, "access %ld %ld", &n, &t) == 2) {
			if (t <= 0) {
				struct job j = { 0, n };

				run_access(&j);
			} else {
				pthread_t th[16];
				struct job jobs[16];

				if (t > 16)
					t = 16;
				for (long k = 0; k < t; k++) {
					jobs[k] = (struct job){ (int)k + 1, n };
					pthread_create(&th[k], NULL, run_access, &jobs[k]);
				}
				for (long k = 0; k < t; k++)
					pthread_join(th[k], NULL);
			}
		} else if (!strncmp(line, "where", 5)) {
			printf("errno_at tid=%ld addr=%p\n", (long)syscall(SYS_gettid), (void *)&errno);
		} else if (!strncmp(line, "quit", 4)) {
			return 0;
		}
		printf("done\n");
	}
	return 0;
}
