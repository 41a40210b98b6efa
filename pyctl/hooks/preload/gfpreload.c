// SPDX-License-Identifier: GPL-2.0-only
/*
 * gfpreload.so: CUDA driver fault injection without BPF (LD_PRELOAD).
 *
 *   GPUFAULT_PRELOAD="cuMemAlloc_v2:nth=3:ret=2;cuLaunchKernel:every=7:ret=719" \
 *   GPUFAULT_PRELOAD_LOG=/tmp/inj.jsonl LD_PRELOAD=./gfpreload.so app
 *
 * Rule keys (all optional, all must hold for a call to fire):
 *   nth=N     only the Nth call (1-based)      every=N  calls N, 2N, 3N, ...
 *   after=N   only calls after the Nth          max=K    at most K fires
 *   prob=PPM  with probability PPM/1e6 (deterministic per call number and
 *             GPUFAULT_PRELOAD_SEED)            sticky   once fired, every
 *             later call fires (max still caps) ret=R    CUresult returned
 * A fired call returns R without entering the driver (skip mode).
 *
 * How calls reach the shim: (1) direct links resolve the exported names
 * to the shim (it is first in the global scope); (2) code that dlopen()s
 * libcuda and dlsym()s a handle bypasses the global scope, so dlsym() is
 * interposed too and hands back the shim's function for the listed names;
 * (3) the CUDA runtime fetches entry points with cuGetProcAddress{,_v2}:
 * those are wrapped, and a returned pointer equal to a listed function's
 * real address (default or _ptsz variant) is swapped for the shim's.
 * Set GPUFAULT_PRELOAD_DLSYM=0 to leave dlsym() alone: the dlsym hook makes
 * dlsym(RTLD_NEXT, ...) calls of *other* interposers resolve relative to
 * this shim.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream;
typedef void *CUfunction;
typedef void *CUgraphExec;
typedef unsigned long long cuuint64_t;

#define GF_MAX_RULES 32

struct rule {
	int used;
	unsigned long long nth, every, after, max, prob_ppm;
	int ret;
	int sticky;
	unsigned long long calls;	/* atomically incremented */
	unsigned long long fires;
	int fired_once;
};

/* One slot per interposed function family; _ptsz shares the rule. */
enum fn_id {
	F_MEMALLOC, F_MEMALLOCASYNC, F_LAUNCH, F_STREAMSYNC, F_CTXSYNC,
	F_GRAPHLAUNCH, F_MEMALLOCMANAGED, F_COUNT
};

static const char *const fn_names[F_COUNT] = {
	"cuMemAlloc_v2", "cuMemAllocAsync", "cuLaunchKernel",
	"cuStreamSynchronize", "cuCtxSynchronize", "cuGraphLaunch",
	"cuMemAllocManaged",
};

/* _ptsz variants (per-thread default stream), NULL where none exists. */
static const char *const fn_ptsz[F_COUNT] = {
	NULL, "cuMemAllocAsync_ptsz", "cuLaunchKernel_ptsz",
	"cuStreamSynchronize_ptsz", NULL, "cuGraphLaunch_ptsz", NULL,
};

/* Default CUresult per function when ret= is not given. */
static const int fn_default_ret[F_COUNT] = {
	2 /* OUT_OF_MEMORY */, 2, 719 /* LAUNCH_FAILED */, 719, 719, 719, 2,
};

static struct rule rules[F_COUNT];
static void *real_fn[F_COUNT];		/* the driver's default variant */
static void *real_fn_ptsz[F_COUNT];	/* the driver's _ptsz variant */
static unsigned long long seed = 0x9e3779b97f4a7c15ULL;
static int log_fd = -1;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static void *(*real_dlsym)(void *, const char *);
static int hook_dlsym = 1;

static void die(const char *what, const char *detail)
{
	/* One line, then a non-zero exit: a half-configured run is worse. */
	fprintf(stderr, "gfpreload: %s '%s'; rules look like "
		"\"cuMemAlloc_v2:nth=3:ret=2;cuLaunchKernel:every=7\" "
		"(keys nth every after max prob ret sticky)\n", what, detail);
	_exit(2);
}

static int fn_lookup(const char *name, size_t len)
{
	for (int i = 0; i < F_COUNT; i++)
		if (strlen(fn_names[i]) == len && !strncmp(fn_names[i], name, len))
			return i;
	return -1;
}

static unsigned long long parse_num(const char *key, const char *v)
{
	char *end;

	errno = 0;
	unsigned long long n = strtoull(v, &end, 0);
	if (errno || end == v || *end || v[0] == '-')
		die("bad number for key", key);
	return n;
}

static void parse_rule(char *text)
{
	char *save = NULL;
	char *name = strtok_r(text, ":", &save);
	int id;
	struct rule *r;

	if (!name || !*name)
		return;
	id = fn_lookup(name, strlen(name));
	if (id < 0)
		die("unknown function (interposable: cuMemAlloc_v2 cuMemAllocAsync "
		    "cuLaunchKernel cuStreamSynchronize cuCtxSynchronize "
		    "cuGraphLaunch cuMemAllocManaged)", name);
	r = &rules[id];
	if (r->used)
		die("second rule for", name);
	r->used = 1;
	r->ret = fn_default_ret[id];
	for (char *kv = strtok_r(NULL, ":", &save); kv; kv = strtok_r(NULL, ":", &save)) {
		char *eq = strchr(kv, '=');
		const char *v = eq ? eq + 1 : "";

		if (eq)
			*eq = 0;
		if (!strcmp(kv, "sticky"))
			r->sticky = eq ? (int)parse_num(kv, v) : 1;
		else if (!eq)
			die("key needs a value", kv);
		else if (!strcmp(kv, "nth"))
			r->nth = parse_num(kv, v);
		else if (!strcmp(kv, "every"))
			r->every = parse_num(kv, v);
		else if (!strcmp(kv, "after"))
			r->after = parse_num(kv, v);
		else if (!strcmp(kv, "max"))
			r->max = parse_num(kv, v);
		else if (!strcmp(kv, "prob")) {
			r->prob_ppm = parse_num(kv, v);
			if (r->prob_ppm > 1000000)
				die("prob is parts per million, at most 1000000:", v);
		} else if (!strcmp(kv, "ret"))
			r->ret = (int)strtol(v, NULL, 0);
		else
			die("unknown key", kv);
	}
}

static void init(void)
{
	const char *spec = getenv("GPUFAULT_PRELOAD");
	const char *logp = getenv("GPUFAULT_PRELOAD_LOG");
	const char *s = getenv("GPUFAULT_PRELOAD_SEED");
	const char *d = getenv("GPUFAULT_PRELOAD_DLSYM");

	if (s && *s)
		seed = parse_num("GPUFAULT_PRELOAD_SEED", s);
	if (d && !strcmp(d, "0"))
		hook_dlsym = 0;
	if (spec) {
		char *copy = strdup(spec);
		char *save = NULL;

		if (!copy)
			die("out of memory parsing", "GPUFAULT_PRELOAD");
		for (char *r = strtok_r(copy, ";", &save); r; r = strtok_r(NULL, ";", &save))
			parse_rule(r);
		free(copy);
	}
	if (logp && *logp) {
		log_fd = open(logp, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
		if (log_fd < 0)
			die("cannot open GPUFAULT_PRELOAD_LOG", logp);
	}
}

__attribute__((constructor)) static void gf_ctor(void)
{
	/* Parse early so a bad rule stops the program before it starts. */
	pthread_once(&init_once, init);
}

static unsigned long long splitmix(unsigned long long x)
{
	x += 0x9e3779b97f4a7c15ULL;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
	return x ^ (x >> 31);
}

/* Decide for this call; returns 1 and sets *ret when it must fail. */
static int should_fire(int id, int *ret, unsigned long long *call_no,
		       unsigned long long *fire_no)
{
	struct rule *r = &rules[id];
	unsigned long long call;
	int hit;

	pthread_once(&init_once, init);
	if (!r->used)
		return 0;
	call = __atomic_add_fetch(&r->calls, 1, __ATOMIC_RELAXED);
	if (r->sticky && __atomic_load_n(&r->fired_once, __ATOMIC_RELAXED)) {
		hit = 1;
	} else {
		hit = 1;
		if (r->nth && call != r->nth)
			hit = 0;
		if (r->every && call % r->every)
			hit = 0;
		if (r->after && call <= r->after)
			hit = 0;
		if (hit && r->prob_ppm &&
		    splitmix(seed ^ ((unsigned long long)id << 56) ^ call) % 1000000 >= r->prob_ppm)
			hit = 0;
	}
	if (!hit)
		return 0;
	*fire_no = __atomic_add_fetch(&r->fires, 1, __ATOMIC_RELAXED);
	if (r->max && *fire_no > r->max)
		return 0;
	__atomic_store_n(&r->fired_once, 1, __ATOMIC_RELAXED);
	*ret = r->ret;
	*call_no = call;
	return 1;
}

static void log_fire(int id, unsigned long long call, unsigned long long fire, int ret,
		     const char *via)
{
	char line[320];
	struct timespec ts;
	int n;

	if (log_fd < 0)
		return;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	n = snprintf(line, sizeof(line),
		     "{\"ts_ns\":%llu,\"pid\":%d,\"tid\":%ld,\"func\":\"%s\",\"via\":\"%s\","
		     "\"call\":%llu,\"fire\":%llu,\"ret\":%d}\n",
		     (unsigned long long)ts.tv_sec * 1000000000ULL + ts.tv_nsec, getpid(),
		     (long)syscall(SYS_gettid), fn_names[id], via, call, fire, ret);
	/* One write per line: O_APPEND keeps lines from threads whole. */
	if (n > 0 && write(log_fd, line, (size_t)n) < 0)
		return;
}

static void *resolve(const char *name)
{
	pthread_once(&init_once, init);
	if (!real_dlsym) {
		real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
		if (!real_dlsym)
			real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
	}
	return real_dlsym ? real_dlsym(RTLD_NEXT, name) : NULL;
}

/* The real function for id; the driver's address may also come from
 * cuGetProcAddress or a handle dlsym, which set the slot first. */
static void *real_of(int id, int ptsz)
{
	void **slot = ptsz ? &real_fn_ptsz[id] : &real_fn[id];
	void *p = __atomic_load_n(slot, __ATOMIC_ACQUIRE);

	if (!p) {
		p = resolve(ptsz ? fn_ptsz[id] : fn_names[id]);
		__atomic_store_n(slot, p, __ATOMIC_RELEASE);
	}
	return p;
}

#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NOT_FOUND 500

/* One wrapper per (function, variant). ARGS/CALL are the prototype. */
#define WRAP(id, sym, ptsz, via, PROTO, ARGS)					\
	CUresult sym PROTO							\
	{									\
		int ret;							\
		unsigned long long call_no, fire_no;				\
		CUresult (*fn) PROTO;						\
		if (should_fire(id, &ret, &call_no, &fire_no)) {		\
			log_fire(id, call_no, fire_no, ret, via);		\
			return ret;						\
		}								\
		fn = (CUresult (*) PROTO)real_of(id, ptsz);			\
		if (!fn)							\
			return CUDA_ERROR_NOT_INITIALIZED;			\
		return fn ARGS;							\
	}

#define P_MEMALLOC (CUdeviceptr *dptr, size_t bytesize)
#define P_MEMALLOCASYNC (CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
#define P_LAUNCH (CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,	\
		  unsigned int bx, unsigned int by, unsigned int bz,			\
		  unsigned int shmem, CUstream hStream, void **params, void **extra)
#define A_LAUNCH (f, gx, gy, gz, bx, by, bz, shmem, hStream, params, extra)
#define P_STREAMSYNC (CUstream hStream)
#define P_CTXSYNC (void)
#define P_GRAPHLAUNCH (CUgraphExec hGraphExec, CUstream hStream)
#define P_MEMALLOCMANAGED (CUdeviceptr *dptr, size_t bytesize, unsigned int flags)

WRAP(F_MEMALLOC, cuMemAlloc_v2, 0, "direct", P_MEMALLOC, (dptr, bytesize))
WRAP(F_MEMALLOCASYNC, cuMemAllocAsync, 0, "direct", P_MEMALLOCASYNC, (dptr, bytesize, hStream))
WRAP(F_MEMALLOCASYNC, cuMemAllocAsync_ptsz, 1, "direct", P_MEMALLOCASYNC,
     (dptr, bytesize, hStream))
WRAP(F_LAUNCH, cuLaunchKernel, 0, "direct", P_LAUNCH, A_LAUNCH)
WRAP(F_LAUNCH, cuLaunchKernel_ptsz, 1, "direct", P_LAUNCH, A_LAUNCH)
WRAP(F_STREAMSYNC, cuStreamSynchronize, 0, "direct", P_STREAMSYNC, (hStream))
WRAP(F_STREAMSYNC, cuStreamSynchronize_ptsz, 1, "direct", P_STREAMSYNC, (hStream))
WRAP(F_CTXSYNC, cuCtxSynchronize, 0, "direct", P_CTXSYNC, ())
WRAP(F_GRAPHLAUNCH, cuGraphLaunch, 0, "direct", P_GRAPHLAUNCH, (hGraphExec, hStream))
WRAP(F_GRAPHLAUNCH, cuGraphLaunch_ptsz, 1, "direct", P_GRAPHLAUNCH, (hGraphExec, hStream))
WRAP(F_MEMALLOCMANAGED, cuMemAllocManaged, 0, "direct", P_MEMALLOCMANAGED,
     (dptr, bytesize, flags))

static void *const wrappers[F_COUNT] = {
	(void *)cuMemAlloc_v2, (void *)cuMemAllocAsync, (void *)cuLaunchKernel,
	(void *)cuStreamSynchronize, (void *)cuCtxSynchronize, (void *)cuGraphLaunch,
	(void *)cuMemAllocManaged,
};

static void *const wrappers_ptsz[F_COUNT] = {
	NULL, (void *)cuMemAllocAsync_ptsz, (void *)cuLaunchKernel_ptsz,
	(void *)cuStreamSynchronize_ptsz, NULL, (void *)cuGraphLaunch_ptsz, NULL,
};

/*
 * Swap a driver pointer for the shim's when it is one of ours. Matching by
 * address, not by the requested name, covers every spelling the runtime
 * asks for ("cuMemAlloc" at version 12000 is cuMemAlloc_v2).
 */
static void *swap_pointer(void *p)
{
	if (!p)
		return p;
	for (int i = 0; i < F_COUNT; i++) {
		if (p == wrappers[i] || (wrappers_ptsz[i] && p == wrappers_ptsz[i]))
			return p;
		if (p == real_of(i, 0))
			return wrappers[i];
		if (fn_ptsz[i] && p == real_of(i, 1))
			return wrappers_ptsz[i];
	}
	return p;
}

/* Record a pointer found by name (handle dlsym) as the real one. */
static void *swap_by_name(const char *name, void *p)
{
	if (!p || !name)
		return p;
	for (int i = 0; i < F_COUNT; i++) {
		if (!strcmp(name, fn_names[i])) {
			__atomic_store_n(&real_fn[i], p, __ATOMIC_RELEASE);
			return wrappers[i];
		}
		if (fn_ptsz[i] && !strcmp(name, fn_ptsz[i])) {
			__atomic_store_n(&real_fn_ptsz[i], p, __ATOMIC_RELEASE);
			return wrappers_ptsz[i];
		}
	}
	return p;
}

typedef CUresult (*gpa_v1_t)(const char *, void **, int, cuuint64_t);
typedef CUresult (*gpa_v2_t)(const char *, void **, int, cuuint64_t, void *);
static gpa_v1_t real_gpa_v1;
static gpa_v2_t real_gpa_v2;

CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
			     void *status);

static void *swap_gpa(const char *symbol, void *p)
{
	/* The runtime may ask cuGetProcAddress for cuGetProcAddress itself. */
	if (symbol && !strcmp(symbol, "cuGetProcAddress") && p) {
		if (!real_gpa_v2 && p != (void *)cuGetProcAddress_v2)
			real_gpa_v2 = (gpa_v2_t)p;
		return (void *)cuGetProcAddress_v2;
	}
	return swap_pointer(p);
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int ver, cuuint64_t flags)
{
	CUresult rc;

	if (!real_gpa_v1)
		real_gpa_v1 = (gpa_v1_t)resolve("cuGetProcAddress");
	if (!real_gpa_v1)
		return CUDA_ERROR_NOT_FOUND;
	rc = real_gpa_v1(symbol, pfn, ver, flags);
	if (rc == 0 && pfn) {
		*pfn = swap_gpa(symbol, *pfn);
		/* v1 handed out for "cuGetProcAddress" must keep its v1 shape. */
		if (symbol && !strcmp(symbol, "cuGetProcAddress") && ver < 12000)
			*pfn = (void *)cuGetProcAddress;
	}
	return rc;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
			     void *status)
{
	CUresult rc;

	if (!real_gpa_v2)
		real_gpa_v2 = (gpa_v2_t)resolve("cuGetProcAddress_v2");
	if (!real_gpa_v2)
		return CUDA_ERROR_NOT_FOUND;
	rc = real_gpa_v2(symbol, pfn, ver, flags, status);
	if (rc == 0 && pfn)
		*pfn = swap_gpa(symbol, *pfn);
	return rc;
}

/*
 * A libcuda dlopen()ed with RTLD_LOCAL is invisible to RTLD_NEXT: take the
 * real addresses from its handle so cuGetProcAddress results can be
 * matched.
 */
static void fill_from_handle(void *handle)
{
	for (int i = 0; i < F_COUNT; i++) {
		if (!__atomic_load_n(&real_fn[i], __ATOMIC_ACQUIRE))
			__atomic_store_n(&real_fn[i], real_dlsym(handle, fn_names[i]),
					 __ATOMIC_RELEASE);
		if (fn_ptsz[i] && !__atomic_load_n(&real_fn_ptsz[i], __ATOMIC_ACQUIRE))
			__atomic_store_n(&real_fn_ptsz[i], real_dlsym(handle, fn_ptsz[i]),
					 __ATOMIC_RELEASE);
	}
}

/*
 * dlsym(handle, name) on a dlopen()ed libcuda does not see LD_PRELOAD:
 * answer the listed names (and cuGetProcAddress{,_v2}) with the shim.
 */
void *dlsym(void *handle, const char *name)
{
	void *p;

	if (!real_dlsym)
		resolve("dlsym");
	p = real_dlsym(handle, name);
	if (!hook_dlsym || !p || handle == RTLD_NEXT || strncmp(name, "cu", 2))
		return p;
	if (!strncmp(name, "cuGetProcAddress", 16))
		fill_from_handle(handle);
	if (!strcmp(name, "cuGetProcAddress")) {
		real_gpa_v1 = (gpa_v1_t)p;
		return (void *)cuGetProcAddress;
	}
	if (!strcmp(name, "cuGetProcAddress_v2")) {
		real_gpa_v2 = (gpa_v2_t)p;
		return (void *)cuGetProcAddress_v2;
	}
	return swap_by_name(name, p);
}
