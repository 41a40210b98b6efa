// SPDX-License-Identifier: GPL-2.0-only
/*
 * Workload for gfpreload's tests, linked directly against libcuda.so.1
 * (the test double next to it). Modes:
 *   gfp-app direct N       each listed function N times by its exported name
 *   gfp-app gpa N          the same through cuGetProcAddress_v2 ("cuMemAlloc",
 *                          "cuLaunchKernel" with the per-thread-stream flag)
 *   gfp-app threads T N    T threads x N cuLaunchKernel calls
 * Prints "<func> <call> <rc>" per call and "entered <func> <n>" at the end.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, void *);
CUresult cuMemAllocManaged(CUdeviceptr *, size_t, unsigned);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			unsigned, void *, void **, void **);
CUresult cuStreamSynchronize(void *);
CUresult cuCtxSynchronize(void);
CUresult cuGraphLaunch(void *, void *);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, void *);
unsigned long long fakecuda_entered(const char *);

static const char *const all[] = { "cuMemAlloc_v2", "cuMemAllocAsync", "cuMemAllocManaged",
	"cuLaunchKernel", "cuLaunchKernel_ptsz", "cuStreamSynchronize", "cuCtxSynchronize",
	"cuGraphLaunch" };
static int nthr_calls;

static void *worker(void *arg)
{
	int *errs = arg;

	for (int i = 0; i < nthr_calls; i++)
		if (cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0))
			__atomic_add_fetch(errs, 1, __ATOMIC_RELAXED);
	return NULL;
}

int main(int argc, char **argv)
{
	CUdeviceptr d;

	if (argc < 3)
		return 2;
	int n = atoi(argv[argc - 1]);
	if (!strcmp(argv[1], "direct")) {
		for (int i = 1; i <= n; i++) {
			printf("cuMemAlloc_v2 %d %d\n", i, cuMemAlloc_v2(&d, 64));
			printf("cuMemAllocAsync %d %d\n", i, cuMemAllocAsync(&d, 64, 0));
			printf("cuMemAllocManaged %d %d\n", i, cuMemAllocManaged(&d, 64, 1));
			printf("cuLaunchKernel %d %d\n", i,
			       cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0));
			printf("cuStreamSynchronize %d %d\n", i, cuStreamSynchronize(0));
			printf("cuCtxSynchronize %d %d\n", i, cuCtxSynchronize());
			printf("cuGraphLaunch %d %d\n", i, cuGraphLaunch(0, 0));
		}
	} else if (!strcmp(argv[1], "gpa")) {
		CUresult (*ma)(CUdeviceptr *, size_t);
		CUresult (*lk)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			       unsigned, void *, void **, void **);
		if (cuGetProcAddress_v2("cuMemAlloc", (void **)&ma, 12000, 0, NULL) ||
		    cuGetProcAddress_v2("cuLaunchKernel", (void **)&lk, 12000, 1, NULL))
			return 3;
		for (int i = 1; i <= n; i++) {
			printf("cuMemAlloc_v2 %d %d\n", i, ma(&d, 64));
			printf("cuLaunchKernel %d %d\n", i, lk(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0));
		}
	} else if (!strcmp(argv[1], "threads") && argc == 4) {
		int t = atoi(argv[2]), errs = 0;
		pthread_t th[64];

		nthr_calls = n;
		for (int i = 0; i < t && i < 64; i++)
			pthread_create(&th[i], NULL, worker, &errs);
		for (int i = 0; i < t && i < 64; i++)
			pthread_join(th[i], NULL);
		printf("errors %d\n", errs);
	} else {
		return 2;
	}
	for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
		printf("entered %s %llu\n", all[i], fakecuda_entered(all[i]));
	return 0;
}
