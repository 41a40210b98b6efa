// SPDX-License-Identifier: GPL-2.0
/*
 * A tiny shared library whose functions the host tests probe: a stand-in for
 * "a function in some library" with a known body and known side effects.
 */
#include <stdint.h>

volatile long gf_body_runs;

/* Returns a + 1 and stores a * 2 through out: the body is observable. */
__attribute__((noinline)) long gf_victim(long a, long *out)
{
	gf_body_runs++;
	if (out)
		*out = a * 2;
	return a + 1;
}

/* An allocator-shaped function: writes a "pointer" through dptr. */
__attribute__((noinline)) int gf_alloc(uint64_t *dptr, uint64_t size)
{
	gf_body_runs++;
	*dptr = 0x100000 + size;
	return 0;
}

/* Empty: the floor for probe-cost benchmarks. */
__attribute__((noinline)) long gf_empty(long a)
{
	return a;
}
