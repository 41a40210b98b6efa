// SPDX-License-Identifier: GPL-2.0-only
/*
 * Workload for gfpreload's tests that reaches libcuda the way the CUDA
 * runtime does: dlopen(RTLD_LOCAL), dlsym(handle, "cuGetProcAddress_v2"),
 * then entry points through it. Usage: gfp-dlopen LIBCUDA N
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef CUresult (*gpa_t)(const char *, void **, int, unsigned long long, void *);

int main(int argc, char **argv)
{
	CUdeviceptr d;
	CUresult (*ma)(CUdeviceptr *, size_t);
	CUresult (*direct)(CUdeviceptr *, size_t);
	unsigned long long (*entered)(const char *);

	if (argc != 3)
		return 2;
	void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		fprintf(stderr, "%s\n", dlerror());
		return 3;
	}
	gpa_t gpa = (gpa_t)dlsym(h, "cuGetProcAddress_v2");
	direct = (CUresult (*)(CUdeviceptr *, size_t))dlsym(h, "cuMemAlloc_v2");
	entered = (unsigned long long (*)(const char *))dlsym(h, "fakecuda_entered");
	if (!gpa || !direct || !entered || gpa("cuMemAlloc", (void **)&ma, 12000, 0, NULL))
		return 4;
	int n = atoi(argv[2]);
	for (int i = 1; i <= n; i++)
		printf("cuMemAlloc_v2 %d %d\n", i, ma(&d, 64));
	for (int i = 1; i <= n; i++)
		printf("handle-dlsym %d %d\n", i, direct(&d, 64));
	printf("entered cuMemAlloc_v2 %llu\n", entered("cuMemAlloc_v2"));
	return 0;
}
