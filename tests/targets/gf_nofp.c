// A C target built -O2 -fomit-frame-pointer (Makefile NOFP_CFLAGS): rbp is
// a general register here, so a frame-pointer walk reads stack data as
// return addresses; only the call-frame information unwinds it
// (tests/test_unwind.py, against perf record --call-graph dwarf).
// Usage: gf_nofp N  -- a thread calls gf_nofp_leaf N times, through three
// levels that keep locals on the stack, then the process exits 0.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static volatile long sink;

__attribute__((noinline)) long gf_nofp_leaf(long x)
{
	sink += x;
	return sink & 0xff;
}

__attribute__((noinline)) static long level3(long x)
{
	volatile char pad[96];
	pad[x & 63] = (char)x;
	return gf_nofp_leaf(x + pad[x & 63]) + 3;
}

__attribute__((noinline)) static long level2(long x)
{
	volatile long pad[24];
	pad[x & 15] = x;
	return level3(pad[x & 15] * 2) + 2;
}

__attribute__((noinline)) static long level1(long x)
{
	long r = level2(x + 1);
	return r ^ (x << 1);
}

static void *worker(void *arg)
{
	long n = (long)arg, acc = 0;
	for (long i = 0; i < n; i++)
		acc += level1(i);
	return (void *)acc;
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? strtol(argv[1], NULL, 10) : 1;
	pthread_t t;
	void *ret;

	if (pthread_create(&t, NULL, worker, (void *)n) != 0)
		return 1;
	pthread_join(t, &ret);
	printf("%ld\n", (long)ret);
	return 0;
}
