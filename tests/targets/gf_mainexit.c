// SPDX-License-Identifier: GPL-2.0
/*
 * Test target whose main thread has exited: main starts W workers that call
 * gf_victim in a loop, and a command reader, then calls pthread_exit. The
 * thread-group leader is then a zombie in /proc (state Z, no maps, no exe,
 * no root) while the process runs on: the case gpufault must not take for
 * an exited process.
 *   gf_mainexit [W]   - W workers (default 1)
 * Commands on stdin, read by the reader thread:
 *   count  - prints "count calls=<n> failed=<k>" (failed: gf_victim did not
 *            return a + 1, i.e. a fault reached the call)
 *   quit   - exit 0
 * Prints "ready pid=<pid>" once the main thread has exited (joined).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

long gf_victim(long a, long *out);

static atomic_long calls, failed;

static void *worker(void *arg)
{
	(void)arg;
	for (long i = 1;; i++) {
		long out = -1;
		long r = gf_victim(i, &out);

		atomic_fetch_add_explicit(&calls, 1, memory_order_relaxed);
		if (r != i + 1)
			atomic_fetch_add_explicit(&failed, 1, memory_order_relaxed);
	}
	return NULL;
}

static void *reader(void *arg)
{
	char line[64];

	/* The main thread is joinable: once joined, it has called pthread_exit. */
	pthread_join(*(pthread_t *)arg, NULL);
	printf("ready pid=%d\n", getpid());
	fflush(stdout);
	while (fgets(line, sizeof(line), stdin)) {
		if (!strncmp(line, "count", 5)) {
			printf("count calls=%ld failed=%ld\n", atomic_load(&calls), atomic_load(&failed));
			fflush(stdout);
		} else if (!strncmp(line, "quit", 4)) {
			exit(0);
		}
	}
	exit(0);
}

int main(int argc, char **argv)
{
	static pthread_t self;
	pthread_t t;
	int w = argc > 1 ? atoi(argv[1]) : 1;

	self = pthread_self();
	for (int i = 0; i < w; i++)
		if (pthread_create(&t, NULL, worker, NULL))
			return 1;
	if (pthread_create(&t, NULL, reader, &self))
		return 1;
	pthread_exit(NULL);
}
