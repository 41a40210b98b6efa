// SPDX-License-Identifier: GPL-2.0-only
/*
 * TEST DOUBLE of libcuda.so.1 for gfpreload's tests: the same exported
 * names and prototypes as the CUDA driver, no GPU. Every function counts
 * how often its body ran (fakecuda_entered) so a test can tell a skipped
 * call from a forwarded one. Allocations are host malloc()s.
 */
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;

enum { MEMALLOC, MEMALLOCASYNC, MEMALLOCASYNC_PTSZ, LAUNCH, LAUNCH_PTSZ, STREAMSYNC,
       STREAMSYNC_PTSZ, CTXSYNC, GRAPHLAUNCH, GRAPHLAUNCH_PTSZ, MEMALLOCMANAGED, NFN };
static const char *const names[NFN] = {
	"cuMemAlloc_v2", "cuMemAllocAsync", "cuMemAllocAsync_ptsz", "cuLaunchKernel",
	"cuLaunchKernel_ptsz", "cuStreamSynchronize", "cuStreamSynchronize_ptsz",
	"cuCtxSynchronize", "cuGraphLaunch", "cuGraphLaunch_ptsz", "cuMemAllocManaged",
};
static unsigned long long entered[NFN];

unsigned long long fakecuda_entered(const char *name)
{
	for (int i = 0; i < NFN; i++)
		if (!strcmp(name, names[i]))
			return __atomic_load_n(&entered[i], __ATOMIC_RELAXED);
	return ~0ULL;
}

#define HIT(i) __atomic_add_fetch(&entered[i], 1, __ATOMIC_RELAXED)

static CUresult alloc(int i, CUdeviceptr *dptr, size_t n)
{
	HIT(i);
	*dptr = (CUdeviceptr)(unsigned long)malloc(n ? n : 1);
	return *dptr ? 0 : 2;
}

CUresult cuMemAlloc_v2(CUdeviceptr *d, size_t n) { return alloc(MEMALLOC, d, n); }
CUresult cuMemAllocAsync(CUdeviceptr *d, size_t n, void *s) { (void)s; return alloc(MEMALLOCASYNC, d, n); }
CUresult cuMemAllocAsync_ptsz(CUdeviceptr *d, size_t n, void *s) { (void)s; return alloc(MEMALLOCASYNC_PTSZ, d, n); }
CUresult cuMemAllocManaged(CUdeviceptr *d, size_t n, unsigned f) { (void)f; return alloc(MEMALLOCMANAGED, d, n); }
#define LAUNCH_ARGS void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, \
	unsigned bz, unsigned sh, void *s, void **p, void **e
#define UNUSED_LAUNCH (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; \
	(void)sh; (void)s; (void)p; (void)e
CUresult cuLaunchKernel(LAUNCH_ARGS) { UNUSED_LAUNCH; HIT(LAUNCH); return 0; }
CUresult cuLaunchKernel_ptsz(LAUNCH_ARGS) { UNUSED_LAUNCH; HIT(LAUNCH_PTSZ); return 0; }
CUresult cuStreamSynchronize(void *s) { (void)s; HIT(STREAMSYNC); return 0; }
CUresult cuStreamSynchronize_ptsz(void *s) { (void)s; HIT(STREAMSYNC_PTSZ); return 0; }
CUresult cuCtxSynchronize(void) { HIT(CTXSYNC); return 0; }
CUresult cuGraphLaunch(void *g, void *s) { (void)g; (void)s; HIT(GRAPHLAUNCH); return 0; }
CUresult cuGraphLaunch_ptsz(void *g, void *s) { (void)g; (void)s; HIT(GRAPHLAUNCH_PTSZ); return 0; }

/* Like the driver: base names, versioned; flag 1 = per-thread stream. */
static void *lookup(const char *sym, int ver, cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags, void *st)
{
	if (st)
		*(int *)st = 0;
	*pfn = lookup(sym, ver, flags);
	return *pfn ? 0 : 500;
}

CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags)
{
	*pfn = lookup(sym, ver, flags);
	return *pfn ? 0 : 500;
}

static void *lookup(const char *sym, int ver, cuuint64_t flags)
{
	int pt = flags & 1;

	if (!strcmp(sym, "cuMemAlloc"))
		return ver >= 3020 ? (void *)cuMemAlloc_v2 : NULL;
	if (!strcmp(sym, "cuMemAllocAsync"))
		return pt ? (void *)cuMemAllocAsync_ptsz : (void *)cuMemAllocAsync;
	if (!strcmp(sym, "cuMemAllocManaged"))
		return (void *)cuMemAllocManaged;
	if (!strcmp(sym, "cuLaunchKernel"))
		return pt ? (void *)cuLaunchKernel_ptsz : (void *)cuLaunchKernel;
	if (!strcmp(sym, "cuStreamSynchronize"))
		return pt ? (void *)cuStreamSynchronize_ptsz : (void *)cuStreamSynchronize;
	if (!strcmp(sym, "cuCtxSynchronize"))
		return (void *)cuCtxSynchronize;
	if (!strcmp(sym, "cuGraphLaunch"))
		return pt ? (void *)cuGraphLaunch_ptsz : (void *)cuGraphLaunch;
	if (!strcmp(sym, "cuGetProcAddress"))
		return ver >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
	return NULL;
}
