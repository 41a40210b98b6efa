/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * libcuda_double.c - a TEST DOUBLE of NVIDIA's libcuda.so.1 that runs on the
 * CPU. It is NOT the CUDA driver: it exports the driver API symbols that the
 * gpufault catalog lists, with the same C calling conventions, and behaves
 * the way the real driver does where a fault-injection test can tell:
 *
 *  - "device memory" is a pool of host memory (GF_DOUBLE_MEM_MIB, default
 *    1024 MiB, mapped lazily); cuMemAlloc_v2 returns CUDA_ERROR_OUT_OF_MEMORY
 *    for real when the pool is exhausted; a CUdeviceptr is the address of the
 *    block in this process.
 *  - copies check device pointers against the live allocations and return
 *    CUDA_ERROR_INVALID_VALUE for memory that is not (or no longer) allocated.
 *  - each stream has a worker thread that runs its work in order; the NULL
 *    stream (and CU_STREAM_LEGACY / CU_STREAM_PER_THREAD) runs work
 *    synchronously in the calling thread.
 *  - built-in "kernels" (gf_fill, gf_axpy, gf_checksum, gf_sleep, gf_trap)
 *    are found through cuModuleLoadData (PTX text naming them in .entry
 *    lines) + cuModuleGetFunction and started with cuLaunchKernel using the
 *    real kernelParams convention.
 *  - sticky errors: a kernel that touches memory outside a live allocation
 *    makes the context fail with CUDA_ERROR_ILLEGAL_ADDRESS (gf_trap: with
 *    CUDA_ERROR_LAUNCH_FAILED); from then on every call that uses the context
 *    returns that code until the context is destroyed (or the primary context
 *    reset).
 *
 * Every exported function starts with `push %rbp` (frame pointers on, no
 * shrink-wrapping, no CET): uprobes on it are emulated, not single-stepped.
 */
#define _GNU_SOURCE
#include "gf_cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default"), noinline))
/* A second exported name for the same code (the _ptsz/_ptds twins, the
 * legacy unversioned symbols): one address, as in the real library. */
#define ALIAS(name, target)                                                        \
	extern __typeof__(target) name __attribute__((alias(#target), visibility("default")))

/*
 * First statement of every exported function: it makes the compiler set up
 * the frame pointer at entry, so the function starts with `push %rbp` even
 * where it would otherwise leave out the frame (leaf functions).
 */
#define ENTRY() __asm__ volatile("" : : "r"(__builtin_frame_address(0)))

#define GF_DRIVER_VERSION 13000
#define GF_ALIGN 256
#define GF_MAX_PARAMS 8

enum { MAGIC_CTX = 0x67666378, MAGIC_STREAM = 0x67667374, MAGIC_EVENT = 0x67666576,
       MAGIC_MOD = 0x67666d64, MAGIC_FUNC = 0x67666664, MAGIC_GRAPH = 0x67666770,
       MAGIC_EXEC = 0x67666578, MAGIC_DEAD = 0x64656164 };

/* ---------------------------------------------------------------- errors */

static const struct { int code; const char *name; } err_names[] = {
	{0, "CUDA_SUCCESS"},
	{1, "CUDA_ERROR_INVALID_VALUE"},
	{2, "CUDA_ERROR_OUT_OF_MEMORY"},
	{3, "CUDA_ERROR_NOT_INITIALIZED"},
	{4, "CUDA_ERROR_DEINITIALIZED"},
	{5, "CUDA_ERROR_PROFILER_DISABLED"},
	{6, "CUDA_ERROR_PROFILER_NOT_INITIALIZED"},
	{7, "CUDA_ERROR_PROFILER_ALREADY_STARTED"},
	{8, "CUDA_ERROR_PROFILER_ALREADY_STOPPED"},
	{34, "CUDA_ERROR_STUB_LIBRARY"},
	{36, "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER"},
	{46, "CUDA_ERROR_DEVICE_UNAVAILABLE"},
	{47, "CUDA_ERROR_MULTICAST_RESOURCE_FULL"},
	{100, "CUDA_ERROR_NO_DEVICE"},
	{101, "CUDA_ERROR_INVALID_DEVICE"},
	{102, "CUDA_ERROR_DEVICE_NOT_LICENSED"},
	{200, "CUDA_ERROR_INVALID_IMAGE"},
	{201, "CUDA_ERROR_INVALID_CONTEXT"},
	{202, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT"},
	{205, "CUDA_ERROR_MAP_FAILED"},
	{206, "CUDA_ERROR_UNMAP_FAILED"},
	{207, "CUDA_ERROR_ARRAY_IS_MAPPED"},
	{208, "CUDA_ERROR_ALREADY_MAPPED"},
	{209, "CUDA_ERROR_NO_BINARY_FOR_GPU"},
	{210, "CUDA_ERROR_ALREADY_ACQUIRED"},
	{211, "CUDA_ERROR_NOT_MAPPED"},
	{212, "CUDA_ERROR_NOT_MAPPED_AS_ARRAY"},
	{213, "CUDA_ERROR_NOT_MAPPED_AS_POINTER"},
	{214, "CUDA_ERROR_ECC_UNCORRECTABLE"},
	{215, "CUDA_ERROR_UNSUPPORTED_LIMIT"},
	{216, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE"},
	{217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"},
	{218, "CUDA_ERROR_INVALID_PTX"},
	{219, "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT"},
	{220, "CUDA_ERROR_NVLINK_UNCORRECTABLE"},
	{221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND"},
	{222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"},
	{223, "CUDA_ERROR_JIT_COMPILATION_DISABLED"},
	{224, "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY"},
	{225, "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC"},
	{226, "CUDA_ERROR_CONTAINED"},
	{227, "CUDA_ERROR_INSUFFICIENT_LOADER_VERSION"},
	{300, "CUDA_ERROR_INVALID_SOURCE"},
	{301, "CUDA_ERROR_FILE_NOT_FOUND"},
	{302, "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND"},
	{303, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED"},
	{304, "CUDA_ERROR_OPERATING_SYSTEM"},
	{400, "CUDA_ERROR_INVALID_HANDLE"},
	{401, "CUDA_ERROR_ILLEGAL_STATE"},
	{402, "CUDA_ERROR_LOSSY_QUERY"},
	{500, "CUDA_ERROR_NOT_FOUND"},
	{600, "CUDA_ERROR_NOT_READY"},
	{700, "CUDA_ERROR_ILLEGAL_ADDRESS"},
	{701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"},
	{702, "CUDA_ERROR_LAUNCH_TIMEOUT"},
	{703, "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING"},
	{704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"},
	{705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED"},
	{708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE"},
	{709, "CUDA_ERROR_CONTEXT_IS_DESTROYED"},
	{710, "CUDA_ERROR_ASSERT"},
	{711, "CUDA_ERROR_TOO_MANY_PEERS"},
	{712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
	{713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
	{714, "CUDA_ERROR_HARDWARE_STACK_ERROR"},
	{715, "CUDA_ERROR_ILLEGAL_INSTRUCTION"},
	{716, "CUDA_ERROR_MISALIGNED_ADDRESS"},
	{717, "CUDA_ERROR_INVALID_ADDRESS_SPACE"},
	{718, "CUDA_ERROR_INVALID_PC"},
	{719, "CUDA_ERROR_LAUNCH_FAILED"},
	{720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"},
	{721, "CUDA_ERROR_TENSOR_MEMORY_LEAK"},
	{800, "CUDA_ERROR_NOT_PERMITTED"},
	{801, "CUDA_ERROR_NOT_SUPPORTED"},
	{802, "CUDA_ERROR_SYSTEM_NOT_READY"},
	{803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"},
	{804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"},
	{805, "CUDA_ERROR_MPS_CONNECTION_FAILED"},
	{806, "CUDA_ERROR_MPS_RPC_FAILURE"},
	{807, "CUDA_ERROR_MPS_SERVER_NOT_READY"},
	{808, "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED"},
	{809, "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED"},
	{810, "CUDA_ERROR_MPS_CLIENT_TERMINATED"},
	{811, "CUDA_ERROR_CDP_NOT_SUPPORTED"},
	{812, "CUDA_ERROR_CDP_VERSION_MISMATCH"},
	{900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"},
	{901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"},
	{902, "CUDA_ERROR_STREAM_CAPTURE_MERGE"},
	{903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED"},
	{904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED"},
	{905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"},
	{906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"},
	{907, "CUDA_ERROR_CAPTURED_EVENT"},
	{908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"},
	{909, "CUDA_ERROR_TIMEOUT"},
	{910, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE"},
	{911, "CUDA_ERROR_EXTERNAL_DEVICE"},
	{912, "CUDA_ERROR_INVALID_CLUSTER_SIZE"},
	{913, "CUDA_ERROR_FUNCTION_NOT_LOADED"},
	{914, "CUDA_ERROR_INVALID_RESOURCE_TYPE"},
	{915, "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION"},
	{916, "CUDA_ERROR_KEY_ROTATION"},
	{917, "CUDA_ERROR_STREAM_DETACHED"},
	{918, "CUDA_ERROR_GRAPH_RECAPTURE_FAILURE"},
	{919, "CUDA_ERROR_FABRIC_NOT_READY"},
	{999, "CUDA_ERROR_UNKNOWN"},
};

static const char *err_name(int code)
{
	for (size_t i = 0; i < sizeof(err_names) / sizeof(err_names[0]); i++)
		if (err_names[i].code == code)
			return err_names[i].name;
	return NULL;
}

/* ------------------------------------------------------------------ pool */

struct seg {
	uintptr_t start;
	size_t size;
	int used;
	int managed;
	struct CUctx_st *ctx;
	struct seg *prev, *next;
};

static struct {
	pthread_mutex_t lock;
	uintptr_t base;
	size_t size;
	size_t used;
	struct seg *head;
} pool = { .lock = PTHREAD_MUTEX_INITIALIZER };

/* 0, or the CUresult cuInit returns: a bad GF_DOUBLE_MEM_MIB is the
 * caller's mistake (INVALID_VALUE), a failed mapping is OUT_OF_MEMORY. */
static CUresult pool_init(void)
{
	size_t mib = 1024;
	const char *env = getenv("GF_DOUBLE_MEM_MIB");
	if (env && *env) {
		char *end;
		unsigned long long v = strtoull(env, &end, 10);
		if (*end || v == 0 || v > (1ULL << 24)) {
			fprintf(stderr, "libcuda double: GF_DOUBLE_MEM_MIB=%s is not a size in MiB "
					"(1..16777216); unset it or fix it\n", env);
			return CUDA_ERROR_INVALID_VALUE;
		}
		mib = v;
	}
	size_t size = mib << 20;
	void *p = mmap(NULL, size, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	struct seg *s = calloc(1, sizeof(*s));
	if (!s) {
		munmap(p, size);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	s->start = (uintptr_t)p;
	s->size = size;
	pool.base = (uintptr_t)p;
	pool.size = size;
	pool.head = s;
	return CUDA_SUCCESS;
}

/* First fit; the caller holds pool.lock. */
static uintptr_t pool_alloc_locked(size_t size, struct CUctx_st *ctx, int managed)
{
	size = (size + GF_ALIGN - 1) & ~(size_t)(GF_ALIGN - 1);
	for (struct seg *s = pool.head; s; s = s->next) {
		if (s->used || s->size < size)
			continue;
		if (s->size > size) {
			struct seg *rest = calloc(1, sizeof(*rest));
			if (!rest)
				return 0;
			rest->start = s->start + size;
			rest->size = s->size - size;
			rest->prev = s;
			rest->next = s->next;
			if (s->next)
				s->next->prev = rest;
			s->next = rest;
			s->size = size;
		}
		s->used = 1;
		s->managed = managed;
		s->ctx = ctx;
		pool.used += s->size;
		return s->start;
	}
	return 0;
}

static void seg_release_locked(struct seg *s)
{
	s->used = 0;
	s->ctx = NULL;
	pool.used -= s->size;
	/* Give big blocks' pages back so a long run does not grow RSS. */
	if (s->size >= (64u << 20))
		madvise((void *)s->start, s->size, MADV_DONTNEED);
	if (s->next && !s->next->used) {
		struct seg *n = s->next;
		s->size += n->size;
		s->next = n->next;
		if (n->next)
			n->next->prev = s;
		free(n);
	}
	if (s->prev && !s->prev->used) {
		struct seg *p = s->prev;
		p->size += s->size;
		p->next = s->next;
		if (s->next)
			s->next->prev = p;
		free(s);
	}
}

static struct seg *pool_find_locked(uintptr_t addr)
{
	if (addr < pool.base || addr >= pool.base + pool.size)
		return NULL;
	for (struct seg *s = pool.head; s; s = s->next)
		if (addr >= s->start && addr < s->start + s->size)
			return s->used ? s : NULL;
	return NULL;
}

/* Is [addr, addr+len) inside one live allocation? */
static int pool_range_ok(uintptr_t addr, size_t len, int *managed)
{
	pthread_mutex_lock(&pool.lock);
	struct seg *s = pool_find_locked(addr);
	int ok = s && len <= s->size - (addr - s->start);
	if (ok && managed)
		*managed = s->managed;
	pthread_mutex_unlock(&pool.lock);
	return ok;
}

static void pool_free_ctx(struct CUctx_st *ctx)
{
	pthread_mutex_lock(&pool.lock);
	for (struct seg *s = pool.head; s;) {
		struct seg *next = s->next;
		if (s->used && s->ctx == ctx) {
			seg_release_locked(s);
			next = pool.head; /* merging may have freed neighbours */
		}
		s = next;
	}
	pthread_mutex_unlock(&pool.lock);
}

/* --------------------------------------------------------------- context */

struct CUstream_st;

struct CUctx_st {
	uint32_t magic;
	int destroyed;
	int primary;
	int dev;
	unsigned int flags;
	_Atomic int sticky;
	pthread_mutex_t lock;
	struct CUstream_st *streams;
};

static atomic_int g_inited;
static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUctx_st g_primary = { .magic = MAGIC_CTX, .primary = 1,
				     .lock = PTHREAD_MUTEX_INITIALIZER };
static int g_primary_refs;
static __thread struct CUctx_st *tls_ctx;

static CUresult check_init(void)
{
	return atomic_load(&g_inited) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

/* The calling thread's usable context, or the error every API call returns. */
static CUresult ctx_enter(struct CUctx_st **out)
{
	if (!atomic_load(&g_inited))
		return CUDA_ERROR_NOT_INITIALIZED;
	struct CUctx_st *c = tls_ctx;
	if (!c)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (c->destroyed)
		return CUDA_ERROR_CONTEXT_IS_DESTROYED;
	int s = atomic_load(&c->sticky);
	if (s)
		return (CUresult)s;
	*out = c;
	return CUDA_SUCCESS;
}

static void ctx_fail(struct CUctx_st *c, CUresult err)
{
	int zero = 0;
	/* The first error wins, as on a GPU. */
	atomic_compare_exchange_strong(&c->sticky, &zero, (int)err);
}

/* ---------------------------------------------------------------- kernels */

struct kernel {
	const char *name;
	int nparams;
	unsigned char sizes[GF_MAX_PARAMS];
	/* p: each parameter's bytes in an 8-byte slot; threads: x threads launched */
	CUresult (*run)(const uint64_t *p, uint64_t threads);
};

static uint64_t min_u64(uint64_t a, uint64_t b)
{
	return a < b ? a : b;
}

/* gf_fill(u64 n, u32 value, u32 *y): y[i] = value */
static CUresult k_fill(const uint64_t *p, uint64_t threads)
{
	uint64_t n = min_u64(p[0], threads);
	uint32_t v = (uint32_t)p[1];
	if (n && !pool_range_ok(p[2], n * 4, NULL))
		return CUDA_ERROR_ILLEGAL_ADDRESS;
	uint32_t *y = (uint32_t *)(uintptr_t)p[2];
	for (uint64_t i = 0; i < n; i++)
		y[i] = v;
	return CUDA_SUCCESS;
}

/* gf_axpy(u64 n, u32 a, const u32 *x, u32 *y): y[i] = a * x[i] + y[i] */
static CUresult k_axpy(const uint64_t *p, uint64_t threads)
{
	uint64_t n = min_u64(p[0], threads);
	uint32_t a = (uint32_t)p[1];
	if (n && (!pool_range_ok(p[2], n * 4, NULL) || !pool_range_ok(p[3], n * 4, NULL)))
		return CUDA_ERROR_ILLEGAL_ADDRESS;
	const uint32_t *x = (const uint32_t *)(uintptr_t)p[2];
	uint32_t *y = (uint32_t *)(uintptr_t)p[3];
	for (uint64_t i = 0; i < n; i++)
		y[i] = a * x[i] + y[i];
	return CUDA_SUCCESS;
}

/* gf_checksum(u64 n, const u32 *x, u64 *out): *out += sum(x[i]) (atomic add) */
static CUresult k_checksum(const uint64_t *p, uint64_t threads)
{
	uint64_t n = min_u64(p[0], threads);
	if ((n && !pool_range_ok(p[1], n * 4, NULL)) || !pool_range_ok(p[2], 8, NULL))
		return CUDA_ERROR_ILLEGAL_ADDRESS;
	const uint32_t *x = (const uint32_t *)(uintptr_t)p[1];
	uint64_t sum = 0;
	for (uint64_t i = 0; i < n; i++)
		sum += x[i];
	__atomic_fetch_add((uint64_t *)(uintptr_t)p[2], sum, __ATOMIC_RELAXED);
	return CUDA_SUCCESS;
}

/* gf_sleep(u64 usec): busy for usec on the stream (a slow kernel) */
static CUresult k_sleep(const uint64_t *p, uint64_t threads)
{
	(void)threads;
	struct timespec ts = { .tv_sec = (time_t)(p[0] / 1000000),
			       .tv_nsec = (long)(p[0] % 1000000) * 1000 };
	while (nanosleep(&ts, &ts) != 0)
		;
	return CUDA_SUCCESS;
}

/* gf_trap(): the PTX `trap` instruction: the launch fails (sticky) */
static CUresult k_trap(const uint64_t *p, uint64_t threads)
{
	(void)p;
	(void)threads;
	return CUDA_ERROR_LAUNCH_FAILED;
}

static const struct kernel kernels[] = {
	{ "gf_fill", 3, { 8, 4, 8 }, k_fill },
	{ "gf_axpy", 4, { 8, 4, 8, 8 }, k_axpy },
	{ "gf_checksum", 3, { 8, 8, 8 }, k_checksum },
	{ "gf_sleep", 1, { 8 }, k_sleep },
	{ "gf_trap", 0, { 0 }, k_trap },
};

/* ------------------------------------------------------------- work items */

enum op_kind { OP_COPY, OP_SET8, OP_SET32, OP_KERNEL, OP_RECORD, OP_WAIT, OP_FREE };

struct CUevent_st {
	uint32_t magic;
	struct CUctx_st *ctx;
	unsigned int flags;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	uint64_t recorded;	/* generation of the last record */
	uint64_t completed;	/* generation the stream has reached */
	struct timespec when;
};

struct CUfunc_st {
	uint32_t magic;
	const struct kernel *k;
	struct CUmod_st *mod;
};

struct op {
	enum op_kind kind;
	struct op *next;
	void *dst;
	const void *src;
	size_t n;
	uint32_t val;
	struct CUfunc_st *func;
	uint64_t threads;
	uint64_t params[GF_MAX_PARAMS];
	struct CUevent_st *ev;
	uint64_t gen;
};

struct CUgraph_st {
	uint32_t magic;
	struct op *head, *tail;
	int nops;
};

struct CUgraphExec_st {
	uint32_t magic;
	struct op *ops; /* array of nops */
	int nops;
};

struct CUstream_st {
	uint32_t magic;
	struct CUctx_st *ctx;
	unsigned int flags;
	int priority;
	pthread_t thr;
	pthread_mutex_t lock;
	pthread_cond_t work;
	pthread_cond_t idle;
	struct op *head, *tail;
	int busy;
	int stop;
	struct CUgraph_st *capture;
	struct CUstream_st *next; /* in ctx->streams */
};

static void event_complete(struct CUevent_st *e, uint64_t gen)
{
	pthread_mutex_lock(&e->lock);
	if (gen > e->completed)
		e->completed = gen;
	clock_gettime(CLOCK_MONOTONIC, &e->when);
	pthread_cond_broadcast(&e->cond);
	pthread_mutex_unlock(&e->lock);
}

static void event_wait_gen(struct CUevent_st *e, uint64_t gen)
{
	pthread_mutex_lock(&e->lock);
	while (e->completed < gen)
		pthread_cond_wait(&e->cond, &e->lock);
	pthread_mutex_unlock(&e->lock);
}

/* Run one work item for context c. Kernel faults become the sticky error. */
static void op_run(struct CUctx_st *c, struct op *o)
{
	if (atomic_load(&c->sticky) && o->kind != OP_RECORD) {
		/* A failed context runs nothing more; records still complete so
		 * no waiter hangs forever. */
		return;
	}
	switch (o->kind) {
	case OP_COPY:
		memmove(o->dst, o->src, o->n);
		break;
	case OP_SET8:
		memset(o->dst, (int)o->val, o->n);
		break;
	case OP_SET32:
		for (size_t i = 0; i < o->n; i++)
			((uint32_t *)o->dst)[i] = o->val;
		break;
	case OP_KERNEL: {
		CUresult r = o->func->k->run(o->params, o->threads);
		if (r != CUDA_SUCCESS)
			ctx_fail(c, r);
		break;
	}
	case OP_RECORD:
		event_complete(o->ev, o->gen);
		break;
	case OP_WAIT:
		event_wait_gen(o->ev, o->gen);
		break;
	case OP_FREE:
		pthread_mutex_lock(&pool.lock);
		struct seg *s = pool_find_locked((uintptr_t)o->dst);
		if (s && s->start == (uintptr_t)o->dst)
			seg_release_locked(s);
		pthread_mutex_unlock(&pool.lock);
		break;
	}
}

static void *stream_main(void *arg)
{
	struct CUstream_st *s = arg;
	pthread_mutex_lock(&s->lock);
	for (;;) {
		while (!s->head && !s->stop)
			pthread_cond_wait(&s->work, &s->lock);
		if (!s->head)
			break;
		struct op *o = s->head;
		s->head = o->next;
		if (!s->head)
			s->tail = NULL;
		s->busy = 1;
		pthread_mutex_unlock(&s->lock);
		if (o->kind != OP_RECORD)
			op_run(s->ctx, o);
		pthread_mutex_lock(&s->lock);
		s->busy = 0;
		/* An event completes with the stream lock held: whoever it wakes
		 * sees this stream idle if the record was its last work. */
		if (o->kind == OP_RECORD)
			event_complete(o->ev, o->gen);
		if (!s->head)
			pthread_cond_broadcast(&s->idle);
		free(o);
	}
	pthread_mutex_unlock(&s->lock);
	return NULL;
}

static void stream_drain(struct CUstream_st *s)
{
	pthread_mutex_lock(&s->lock);
	while (s->head || s->busy)
		pthread_cond_wait(&s->idle, &s->lock);
	pthread_mutex_unlock(&s->lock);
}

static void ctx_drain(struct CUctx_st *c)
{
	pthread_mutex_lock(&c->lock);
	for (struct CUstream_st *s = c->streams; s; s = s->next)
		stream_drain(s);
	pthread_mutex_unlock(&c->lock);
}

/* NULL, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD run work in the caller:
 * *out = NULL. Anything else must be a live stream of context c. */
static CUresult stream_resolve(struct CUctx_st *c, CUstream h, struct CUstream_st **out)
{
	if (h == NULL || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD) {
		*out = NULL;
		return CUDA_SUCCESS;
	}
	if (h->magic != MAGIC_STREAM)
		return CUDA_ERROR_INVALID_HANDLE;
	if (h->ctx != c)
		return CUDA_ERROR_INVALID_CONTEXT;
	*out = h;
	return CUDA_SUCCESS;
}

static struct op *op_new(enum op_kind kind)
{
	struct op *o = calloc(1, sizeof(*o));
	if (o)
		o->kind = kind;
	return o;
}

static void graph_append(struct CUgraph_st *g, struct op *o)
{
	o->next = NULL;
	if (g->tail)
		g->tail->next = o;
	else
		g->head = o;
	g->tail = o;
	g->nops++;
}

/* Hand op o to stream s (NULL: run it now). Takes ownership of o. */
static CUresult submit(struct CUctx_st *c, struct CUstream_st *s, struct op *o)
{
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (!s) {
		op_run(c, o);
		free(o);
		return CUDA_SUCCESS;
	}
	pthread_mutex_lock(&s->lock);
	if (s->capture) {
		/* Stream capture: the work becomes a graph node instead of running. */
		graph_append(s->capture, o);
		pthread_mutex_unlock(&s->lock);
		return CUDA_SUCCESS;
	}
	o->next = NULL;
	if (s->tail)
		s->tail->next = o;
	else
		s->head = o;
	s->tail = o;
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&s->lock);
	return CUDA_SUCCESS;
}

/* ========================================================== exported API */

/* ------------------------------------------------- init, device, errors */

API CUresult cuInit(unsigned int Flags)
{
	ENTRY();
	if (Flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&g_init_lock);
	CUresult r = CUDA_SUCCESS;
	if (!atomic_load(&g_inited)) {
		r = pool_init();
		if (r == CUDA_SUCCESS)
			atomic_store(&g_inited, 1);
	}
	pthread_mutex_unlock(&g_init_lock);
	return r;
}

API CUresult cuDriverGetVersion(int *driverVersion)
{
	ENTRY();
	if (!driverVersion)
		return CUDA_ERROR_INVALID_VALUE;
	*driverVersion = GF_DRIVER_VERSION;
	return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
	ENTRY();
	CUresult r = check_init();
	if (r)
		return r;
	if (!device)
		return CUDA_ERROR_INVALID_VALUE;
	if (ordinal != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	*device = 0;
	return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *count)
{
	ENTRY();
	CUresult r = check_init();
	if (r)
		return r;
	if (!count)
		return CUDA_ERROR_INVALID_VALUE;
	*count = 1;
	return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
{
	ENTRY();
	CUresult r = check_init();
	if (r)
		return r;
	if (!name || len <= 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (dev != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	snprintf(name, (size_t)len, "gpufault libcuda TEST DOUBLE (CPU)");
	return CUDA_SUCCESS;
}

API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
	ENTRY();
	CUresult r = check_init();
	if (r)
		return r;
	if (!bytes)
		return CUDA_ERROR_INVALID_VALUE;
	if (dev != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	*bytes = pool.size;
	return CUDA_SUCCESS;
}

API CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
	ENTRY();
	CUresult r = check_init();
	if (r)
		return r;
	if (!pi)
		return CUDA_ERROR_INVALID_VALUE;
	if (dev != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	switch (attrib) {
	case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK:
	case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X:
		*pi = 1024;
		break;
	case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X:
		*pi = 2147483647;
		break;
	case CU_DEVICE_ATTRIBUTE_WARP_SIZE:
		*pi = 32;
		break;
	case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
		*pi = (int)sysconf(_SC_NPROCESSORS_ONLN);
		break;
	case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING:
	case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY:
	case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS:
		*pi = 1;
		break;
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
		*pi = 9;
		break;
	case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
		*pi = 0;
		break;
	default:
		return CUDA_ERROR_INVALID_VALUE;
	}
	return CUDA_SUCCESS;
}

static CUresult error_name(CUresult error, const char **pStr)
{
	if (!pStr)
		return CUDA_ERROR_INVALID_VALUE;
	*pStr = err_name((int)error);
	return *pStr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGetErrorName(CUresult error, const char **pStr)
{
	ENTRY();
	return error_name(error, pStr);
}

API CUresult cuGetErrorString(CUresult error, const char **pStr)
{
	ENTRY();
	/* The real driver returns prose; the double returns the name. */
	return error_name(error, pStr);
}

/* --------------------------------------------------------------- context */

static CUresult ctx_new(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
	CUresult r = check_init();
	if (r)
		return r;
	if (!pctx)
		return CUDA_ERROR_INVALID_VALUE;
	if (dev != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	struct CUctx_st *c = calloc(1, sizeof(*c));
	if (!c)
		return CUDA_ERROR_OUT_OF_MEMORY;
	c->magic = MAGIC_CTX;
	c->flags = flags;
	pthread_mutex_init(&c->lock, NULL);
	tls_ctx = c; /* a new context is made current, as in the driver */
	*pctx = c;
	return CUDA_SUCCESS;
}

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
	ENTRY();
	return ctx_new(pctx, flags, dev);
}
ALIAS(cuCtxCreate, cuCtxCreate_v2);

API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
			    unsigned int flags, CUdevice dev)
{
	ENTRY();
	if (numParams < 0 || (numParams > 0 && !paramsArray))
		return CUDA_ERROR_INVALID_VALUE;
	return ctx_new(pctx, flags, dev);
}

API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams,
			    unsigned int flags, CUdevice dev)
{
	ENTRY();
	(void)ctxCreateParams; /* affinity / CIG: nothing to honour on a CPU */
	return ctx_new(pctx, flags, dev);
}

static void ctx_teardown(struct CUctx_st *c)
{
	pthread_mutex_lock(&c->lock);
	struct CUstream_st *s = c->streams;
	c->streams = NULL;
	pthread_mutex_unlock(&c->lock);
	while (s) {
		struct CUstream_st *next = s->next;
		pthread_mutex_lock(&s->lock);
		s->stop = 1;
		pthread_cond_signal(&s->work);
		pthread_mutex_unlock(&s->lock);
		pthread_join(s->thr, NULL);
		s->magic = MAGIC_DEAD; /* kept, so a stale handle is recognised */
		s = next;
	}
	pool_free_ctx(c);
}

API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
	ENTRY();
	CUresult r = check_init();
	if (r)
		return r;
	if (!ctx || ctx->magic != MAGIC_CTX || ctx->primary)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (ctx->destroyed)
		return CUDA_ERROR_CONTEXT_IS_DESTROYED;
	ctx_teardown(ctx);
	ctx->destroyed = 1; /* never freed: stale handles stay detectable */
	return CUDA_SUCCESS;
}

API CUresult cuCtxSynchronize(void)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	ctx_drain(c);
	return (CUresult)atomic_load(&c->sticky);
}

API CUresult cuCtxSetCurrent(CUcontext ctx)
{
	ENTRY();
	CUresult r = check_init();
	if (r)
		return r;
	if (ctx && ctx->magic != MAGIC_CTX)
		return CUDA_ERROR_INVALID_CONTEXT;
	tls_ctx = ctx;
	return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
	ENTRY();
	CUresult r = check_init();
	if (r)
		return r;
	if (!pctx)
		return CUDA_ERROR_INVALID_VALUE;
	*pctx = tls_ctx;
	return CUDA_SUCCESS;
}

API CUresult cuCtxGetDevice(CUdevice *device)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!device)
		return CUDA_ERROR_INVALID_VALUE;
	*device = c->dev;
	return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
	ENTRY();
	CUresult r = check_init();
	if (r)
		return r;
	if (!pctx)
		return CUDA_ERROR_INVALID_VALUE;
	if (dev != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&g_init_lock);
	g_primary_refs++;
	g_primary.destroyed = 0;
	pthread_mutex_unlock(&g_init_lock);
	*pctx = &g_primary;
	return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
	ENTRY();
	CUresult r = check_init();
	if (r)
		return r;
	if (dev != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&g_init_lock);
	int refs = g_primary_refs > 0 ? --g_primary_refs : -1;
	pthread_mutex_unlock(&g_init_lock);
	if (refs < 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev)
{
	ENTRY();
	CUresult r = check_init();
	if (r)
		return r;
	if (dev != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	/* Frees everything and clears a sticky error: the recovery path. */
	ctx_teardown(&g_primary);
	atomic_store(&g_primary.sticky, 0);
	return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- streams */

static CUresult stream_new(CUstream *ph, unsigned int flags, int priority)
{
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!ph || (flags & ~CU_STREAM_NON_BLOCKING))
		return CUDA_ERROR_INVALID_VALUE;
	struct CUstream_st *s = calloc(1, sizeof(*s));
	if (!s)
		return CUDA_ERROR_OUT_OF_MEMORY;
	s->magic = MAGIC_STREAM;
	s->ctx = c;
	s->flags = flags;
	s->priority = priority;
	pthread_mutex_init(&s->lock, NULL);
	pthread_cond_init(&s->work, NULL);
	pthread_cond_init(&s->idle, NULL);
	if (pthread_create(&s->thr, NULL, stream_main, s) != 0) {
		free(s);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	pthread_mutex_lock(&c->lock);
	s->next = c->streams;
	c->streams = s;
	pthread_mutex_unlock(&c->lock);
	*ph = s;
	return CUDA_SUCCESS;
}

API CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
	ENTRY();
	return stream_new(phStream, Flags, 0);
}

API CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority)
{
	ENTRY();
	return stream_new(phStream, flags, priority);
}

API CUresult cuStreamSynchronize(CUstream hStream)
{
	ENTRY();
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	r = stream_resolve(c, hStream, &s);
	if (r)
		return r;
	if (s && s->capture)
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	if (s)
		stream_drain(s);
	else
		ctx_drain(c); /* the legacy stream waits for the others */
	/* Errors of asynchronous work surface here. */
	return (CUresult)atomic_load(&c->sticky);
}
ALIAS(cuStreamSynchronize_ptsz, cuStreamSynchronize);

API CUresult cuStreamQuery(CUstream hStream)
{
	ENTRY();
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	r = stream_resolve(c, hStream, &s);
	if (r || !s)
		return r;
	pthread_mutex_lock(&s->lock);
	int busy = s->head || s->busy;
	pthread_mutex_unlock(&s->lock);
	return busy ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}
ALIAS(cuStreamQuery_ptsz, cuStreamQuery);

API CUresult cuStreamDestroy_v2(CUstream hStream)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!hStream || hStream->magic != MAGIC_STREAM || hStream->ctx != c)
		return CUDA_ERROR_INVALID_HANDLE;
	struct CUstream_st *s = hStream;
	pthread_mutex_lock(&c->lock);
	for (struct CUstream_st **pp = &c->streams; *pp; pp = &(*pp)->next)
		if (*pp == s) {
			*pp = s->next;
			break;
		}
	pthread_mutex_unlock(&c->lock);
	/* Work already queued still runs, as in the driver. */
	pthread_mutex_lock(&s->lock);
	s->stop = 1;
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&s->lock);
	pthread_join(s->thr, NULL);
	s->magic = MAGIC_DEAD;
	return CUDA_SUCCESS;
}

/* ----------------------------------------------------------------- events */

API CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!phEvent || (Flags & ~0xfu))
		return CUDA_ERROR_INVALID_VALUE;
	struct CUevent_st *e = calloc(1, sizeof(*e));
	if (!e)
		return CUDA_ERROR_OUT_OF_MEMORY;
	e->magic = MAGIC_EVENT;
	e->ctx = c;
	e->flags = Flags;
	pthread_mutex_init(&e->lock, NULL);
	pthread_cond_init(&e->cond, NULL);
	*phEvent = e;
	return CUDA_SUCCESS;
}

static CUresult event_check(struct CUctx_st **c, CUevent e)
{
	CUresult r = ctx_enter(c);
	if (r)
		return r;
	if (!e || e->magic != MAGIC_EVENT)
		return CUDA_ERROR_INVALID_HANDLE;
	return CUDA_SUCCESS;
}

static CUresult event_record(CUevent hEvent, CUstream hStream)
{
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = event_check(&c, hEvent);
	if (r)
		return r;
	r = stream_resolve(c, hStream, &s);
	if (r)
		return r;
	struct op *o = op_new(OP_RECORD);
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&hEvent->lock);
	o->gen = ++hEvent->recorded;
	pthread_mutex_unlock(&hEvent->lock);
	o->ev = hEvent;
	return submit(c, s, o);
}

API CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
	ENTRY();
	return event_record(hEvent, hStream);
}
ALIAS(cuEventRecord_ptsz, cuEventRecord);

API CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags)
{
	ENTRY();
	if (flags & ~1u)
		return CUDA_ERROR_INVALID_VALUE;
	return event_record(hEvent, hStream);
}
ALIAS(cuEventRecordWithFlags_ptsz, cuEventRecordWithFlags);

API CUresult cuEventSynchronize(CUevent hEvent)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = event_check(&c, hEvent);
	if (r)
		return r;
	pthread_mutex_lock(&hEvent->lock);
	uint64_t gen = hEvent->recorded;
	pthread_mutex_unlock(&hEvent->lock);
	event_wait_gen(hEvent, gen);
	return (CUresult)atomic_load(&c->sticky);
}

static int event_done(CUevent e)
{
	pthread_mutex_lock(&e->lock);
	int done = e->completed >= e->recorded;
	pthread_mutex_unlock(&e->lock);
	return done;
}

API CUresult cuEventQuery(CUevent hEvent)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = event_check(&c, hEvent);
	if (r)
		return r;
	return event_done(hEvent) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

API CUresult cuEventDestroy_v2(CUevent hEvent)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = event_check(&c, hEvent);
	if (r)
		return r;
	hEvent->magic = MAGIC_DEAD; /* kept: a queued wait may still read it */
	return CUDA_SUCCESS;
}

API CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = event_check(&c, hStart);
	if (r)
		return r;
	if (!hEnd || hEnd->magic != MAGIC_EVENT)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!pMilliseconds)
		return CUDA_ERROR_INVALID_VALUE;
	if (!hStart->recorded || !hEnd->recorded)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!event_done(hStart) || !event_done(hEnd))
		return CUDA_ERROR_NOT_READY;
	double ms = (double)(hEnd->when.tv_sec - hStart->when.tv_sec) * 1e3 +
		    (double)(hEnd->when.tv_nsec - hStart->when.tv_nsec) / 1e6;
	*pMilliseconds = (float)ms;
	return CUDA_SUCCESS;
}
ALIAS(cuEventElapsedTime, cuEventElapsedTime_v2);

API CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
	ENTRY();
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = event_check(&c, hEvent);
	if (r)
		return r;
	if (Flags & ~1u)
		return CUDA_ERROR_INVALID_VALUE;
	r = stream_resolve(c, hStream, &s);
	if (r)
		return r;
	struct op *o = op_new(OP_WAIT);
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&hEvent->lock);
	o->gen = hEvent->recorded; /* waits for the latest record, not later ones */
	pthread_mutex_unlock(&hEvent->lock);
	o->ev = hEvent;
	return submit(c, s, o);
}
ALIAS(cuStreamWaitEvent_ptsz, cuStreamWaitEvent);

/* ----------------------------------------------------------------- memory */

static CUresult mem_alloc(CUdeviceptr *dptr, size_t bytesize, int managed)
{
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!dptr || bytesize == 0)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&pool.lock);
	uintptr_t p = pool_alloc_locked(bytesize, c, managed);
	pthread_mutex_unlock(&pool.lock);
	if (!p)
		return CUDA_ERROR_OUT_OF_MEMORY; /* the pool is really exhausted */
	*dptr = (CUdeviceptr)p;
	return CUDA_SUCCESS;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
	ENTRY();
	return mem_alloc(dptr, bytesize, 0);
}
ALIAS(cuMemAlloc, cuMemAlloc_v2);

API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
	ENTRY();
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	r = stream_resolve(c, hStream, &s);
	if (r)
		return r;
	/* Stream-ordered allocation, simplified: the memory exists at once. */
	return mem_alloc(dptr, bytesize, 0);
}
ALIAS(cuMemAllocAsync_ptsz, cuMemAllocAsync);

API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
	ENTRY();
	if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)
		return CUDA_ERROR_INVALID_VALUE;
	return mem_alloc(dptr, bytesize, 1);
}

API CUresult cuMemAllocHost_v2(void **pp, size_t bytesize)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!pp || bytesize == 0)
		return CUDA_ERROR_INVALID_VALUE;
	/* Pinned host memory is ordinary host memory here. */
	*pp = malloc(bytesize);
	return *pp ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

API CUresult cuMemFreeHost(void *p)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	free(p);
	return CUDA_SUCCESS;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	pthread_mutex_lock(&pool.lock);
	struct seg *s = pool_find_locked((uintptr_t)dptr);
	if (s && s->start == (uintptr_t)dptr)
		seg_release_locked(s);
	else
		r = CUDA_ERROR_INVALID_VALUE; /* not the start of a live allocation */
	pthread_mutex_unlock(&pool.lock);
	return r;
}
ALIAS(cuMemFree, cuMemFree_v2);

API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
	ENTRY();
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	r = stream_resolve(c, hStream, &s);
	if (r)
		return r;
	pthread_mutex_lock(&pool.lock);
	struct seg *sg = pool_find_locked((uintptr_t)dptr);
	int ok = sg && sg->start == (uintptr_t)dptr;
	pthread_mutex_unlock(&pool.lock);
	if (!ok)
		return CUDA_ERROR_INVALID_VALUE;
	struct op *o = op_new(OP_FREE);
	if (o)
		o->dst = (void *)(uintptr_t)dptr;
	return submit(c, s, o);
}
ALIAS(cuMemFreeAsync_ptsz, cuMemFreeAsync);

API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!free_bytes || !total)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&pool.lock);
	*free_bytes = pool.size - pool.used;
	*total = pool.size;
	pthread_mutex_unlock(&pool.lock);
	return CUDA_SUCCESS;
}

/* ----------------------------------------------------------------- copies */

/* dst_dev/src_dev: whether that side is device memory and must be checked. */
static CUresult copy(uintptr_t dst, int dst_dev, uintptr_t src, int src_dev, size_t n,
		     CUstream hStream, int async)
{
	struct CUctx_st *c;
	struct CUstream_st *s = NULL;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (async) {
		r = stream_resolve(c, hStream, &s);
		if (r)
			return r;
	}
	if (n == 0)
		return CUDA_SUCCESS;
	if (!dst || !src)
		return CUDA_ERROR_INVALID_VALUE;
	/* The driver rejects device ranges that are not (wholly) allocated. */
	if ((dst_dev && !pool_range_ok(dst, n, NULL)) || (src_dev && !pool_range_ok(src, n, NULL)))
		return CUDA_ERROR_INVALID_VALUE;
	struct op *o = op_new(OP_COPY);
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	o->dst = (void *)dst;
	o->src = (const void *)src;
	o->n = n;
	return submit(c, s, o);
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
	ENTRY();
	return copy((uintptr_t)dstDevice, 1, (uintptr_t)srcHost, 0, ByteCount, NULL, 0);
}
ALIAS(cuMemcpyHtoD_v2_ptds, cuMemcpyHtoD_v2);

API CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
	ENTRY();
	return copy((uintptr_t)dstHost, 0, (uintptr_t)srcDevice, 1, ByteCount, NULL, 0);
}
ALIAS(cuMemcpyDtoH_v2_ptds, cuMemcpyDtoH_v2);

API CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
	ENTRY();
	return copy((uintptr_t)dstDevice, 1, (uintptr_t)srcDevice, 1, ByteCount, NULL, 0);
}
ALIAS(cuMemcpyDtoD_v2_ptds, cuMemcpyDtoD_v2);

API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
				  CUstream hStream)
{
	ENTRY();
	return copy((uintptr_t)dstDevice, 1, (uintptr_t)srcHost, 0, ByteCount, hStream, 1);
}
ALIAS(cuMemcpyHtoDAsync_v2_ptsz, cuMemcpyHtoDAsync_v2);

API CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
				  CUstream hStream)
{
	ENTRY();
	return copy((uintptr_t)dstHost, 0, (uintptr_t)srcDevice, 1, ByteCount, hStream, 1);
}
ALIAS(cuMemcpyDtoHAsync_v2_ptsz, cuMemcpyDtoHAsync_v2);

API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
				  CUstream hStream)
{
	ENTRY();
	return copy((uintptr_t)dstDevice, 1, (uintptr_t)srcDevice, 1, ByteCount, hStream, 1);
}
ALIAS(cuMemcpyDtoDAsync_v2_ptsz, cuMemcpyDtoDAsync_v2);

API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream)
{
	ENTRY();
	/* Unified addressing: a side inside the pool is device memory. */
	int dd = dst >= pool.base && dst < pool.base + pool.size;
	int sd = src >= pool.base && src < pool.base + pool.size;
	return copy((uintptr_t)dst, dd, (uintptr_t)src, sd, ByteCount, hStream, 1);
}
ALIAS(cuMemcpyAsync_ptsz, cuMemcpyAsync);

static CUresult memset_dev(CUdeviceptr dst, uint32_t val, size_t n, size_t width)
{
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (n == 0)
		return CUDA_SUCCESS;
	if (n > SIZE_MAX / width || !pool_range_ok((uintptr_t)dst, n * width, NULL))
		return CUDA_ERROR_INVALID_VALUE;
	if (width == 4 && (dst & 3))
		return CUDA_ERROR_INVALID_VALUE;
	struct op *o = op_new(width == 1 ? OP_SET8 : OP_SET32);
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	o->dst = (void *)(uintptr_t)dst;
	o->val = val;
	o->n = n;
	return submit(c, NULL, o);
}

API CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
{
	ENTRY();
	return memset_dev(dstDevice, uc, N, 1);
}
ALIAS(cuMemsetD8_v2_ptds, cuMemsetD8_v2);

API CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N)
{
	ENTRY();
	return memset_dev(dstDevice, ui, N, 4);
}
ALIAS(cuMemsetD32_v2_ptds, cuMemsetD32_v2);

/* ---------------------------------------------------------- unified memory */

/* Prefetch and advice are hints on a CPU; the checks are the driver's. */
static CUresult managed_check(CUdeviceptr devPtr, size_t count)
{
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	int managed = 0;
	if (count == 0 || !pool_range_ok((uintptr_t)devPtr, count, &managed) || !managed)
		return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

API CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice,
				CUstream hStream)
{
	ENTRY();
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = managed_check(devPtr, count);
	if (r)
		return r;
	if (dstDevice != 0 && dstDevice != -1) /* -1: CU_DEVICE_CPU */
		return CUDA_ERROR_INVALID_DEVICE;
	ctx_enter(&c);
	return stream_resolve(c, hStream, &s);
}
ALIAS(cuMemPrefetchAsync_ptsz, cuMemPrefetchAsync);

API CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location,
				   unsigned int flags, CUstream hStream)
{
	ENTRY();
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = managed_check(devPtr, count);
	if (r)
		return r;
	if (flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (location.type == CU_MEM_LOCATION_TYPE_DEVICE && location.id != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	if (location.type < CU_MEM_LOCATION_TYPE_DEVICE ||
	    location.type > CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT)
		return CUDA_ERROR_INVALID_VALUE;
	ctx_enter(&c);
	return stream_resolve(c, hStream, &s);
}
ALIAS(cuMemPrefetchAsync_v2_ptsz, cuMemPrefetchAsync_v2);

API CUresult cuMemAdvise(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUdevice device)
{
	ENTRY();
	CUresult r = managed_check(devPtr, count);
	if (r)
		return r;
	if (advice < CU_MEM_ADVISE_SET_READ_MOSTLY || advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY)
		return CUDA_ERROR_INVALID_VALUE;
	if (device != 0 && device != -1)
		return CUDA_ERROR_INVALID_DEVICE;
	return CUDA_SUCCESS;
}

API CUresult cuMemAdvise_v2(CUdeviceptr devPtr, size_t count, CUmem_advise advice,
			    CUmemLocation location)
{
	ENTRY();
	CUresult r = managed_check(devPtr, count);
	if (r)
		return r;
	if (advice < CU_MEM_ADVISE_SET_READ_MOSTLY || advice > CU_MEM_ADVISE_UNSET_ACCESSED_BY)
		return CUDA_ERROR_INVALID_VALUE;
	if (location.type == CU_MEM_LOCATION_TYPE_DEVICE && location.id != 0)
		return CUDA_ERROR_INVALID_DEVICE;
	return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- modules */

#define GF_MAX_ENTRIES 32

struct CUmod_st {
	uint32_t magic;
	int nentries;
	char entries[GF_MAX_ENTRIES][64];
};

static CUresult module_load(CUmodule *module, const void *image)
{
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!module || !image)
		return CUDA_ERROR_INVALID_VALUE;
	const unsigned char *b = image;
	/* cubin (ELF) or fatbin: machine code a CPU cannot run. */
	if ((b[0] == 0x7f && b[1] == 'E' && b[2] == 'L' && b[3] == 'F') ||
	    (b[0] == 0x50 && b[1] == 0xed && b[2] == 0x55 && b[3] == 0xba))
		return CUDA_ERROR_NO_BINARY_FOR_GPU;
	const char *ptx = image;
	if (!strstr(ptx, ".version") || !strstr(ptx, ".target"))
		return CUDA_ERROR_INVALID_IMAGE;
	struct CUmod_st *m = calloc(1, sizeof(*m));
	if (!m)
		return CUDA_ERROR_OUT_OF_MEMORY;
	m->magic = MAGIC_MOD;
	/* The kernels are the PTX's `.entry NAME(` lines. */
	for (const char *p = ptx; (p = strstr(p, ".entry")) && m->nentries < GF_MAX_ENTRIES;) {
		p += 6;
		while (*p == ' ' || *p == '\t')
			p++;
		size_t n = strcspn(p, " \t\r\n(");
		if (n == 0 || n >= sizeof(m->entries[0])) {
			free(m);
			return CUDA_ERROR_INVALID_PTX;
		}
		memcpy(m->entries[m->nentries++], p, n);
		p += n;
	}
	*module = m;
	return CUDA_SUCCESS;
}

API CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
	ENTRY();
	return module_load(module, image);
}

API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!hfunc || !name)
		return CUDA_ERROR_INVALID_VALUE;
	if (!hmod || hmod->magic != MAGIC_MOD)
		return CUDA_ERROR_INVALID_HANDLE;
	int found = 0;
	for (int i = 0; i < hmod->nentries; i++)
		found |= strcmp(hmod->entries[i], name) == 0;
	if (!found)
		return CUDA_ERROR_NOT_FOUND;
	for (size_t i = 0; i < sizeof(kernels) / sizeof(kernels[0]); i++) {
		if (strcmp(kernels[i].name, name) != 0)
			continue;
		struct CUfunc_st *f = calloc(1, sizeof(*f));
		if (!f)
			return CUDA_ERROR_OUT_OF_MEMORY;
		f->magic = MAGIC_FUNC;
		f->k = &kernels[i];
		f->mod = hmod;
		*hfunc = f;
		return CUDA_SUCCESS;
	}
	/* In the PTX but not a built-in: the double cannot run arbitrary PTX. */
	return CUDA_ERROR_NOT_SUPPORTED;
}

API CUresult cuModuleUnload(CUmodule hmod)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!hmod || hmod->magic != MAGIC_MOD)
		return CUDA_ERROR_INVALID_HANDLE;
	hmod->magic = MAGIC_DEAD; /* functions of it become invalid handles */
	return CUDA_SUCCESS;
}

/* --------------------------------------------------------------- launches */

static CUresult launch(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
		       unsigned int bx, unsigned int by, unsigned int bz, CUstream hStream,
		       void **kernelParams, void **extra)
{
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!f || f->magic != MAGIC_FUNC || f->mod->magic != MAGIC_MOD)
		return CUDA_ERROR_INVALID_HANDLE;
	r = stream_resolve(c, hStream, &s);
	if (r)
		return r;
	if (!gx || !gy || !gz || !bx || !by || !bz || gy > 65535 || gz > 65535 || bx > 1024 ||
	    by > 1024 || bz > 64 || (uint64_t)bx * by * bz > 1024)
		return CUDA_ERROR_INVALID_VALUE;
	if (extra)
		return CUDA_ERROR_NOT_SUPPORTED; /* CU_LAUNCH_PARAM_BUFFER_*: not in the double */
	if (f->k->nparams && !kernelParams)
		return CUDA_ERROR_INVALID_VALUE;
	struct op *o = op_new(OP_KERNEL);
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	o->func = f;
	/* The 1-D kernels index with ctaid.x * ntid.x + tid.x. */
	o->threads = (uint64_t)gx * bx;
	/* Parameters are copied at launch time, as the driver does. */
	for (int i = 0; i < f->k->nparams; i++)
		memcpy(&o->params[i], kernelParams[i], f->k->sizes[i]);
	return submit(c, s, o);
}

API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
			    unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
			    unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
			    void **kernelParams, void **extra)
{
	ENTRY();
	(void)sharedMemBytes;
	return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream,
		      kernelParams, extra);
}
ALIAS(cuLaunchKernel_ptsz, cuLaunchKernel);

API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
			      void **extra)
{
	ENTRY();
	if (!config)
		return CUDA_ERROR_INVALID_VALUE;
	return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
		      config->blockDimY, config->blockDimZ, config->hStream, kernelParams, extra);
}
ALIAS(cuLaunchKernelEx_ptsz, cuLaunchKernelEx);

/* ----------------------------------------------------------------- graphs */

static struct CUgraph_st *graph_new(void)
{
	struct CUgraph_st *g = calloc(1, sizeof(*g));
	if (g)
		g->magic = MAGIC_GRAPH;
	return g;
}

API CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!phGraph || flags)
		return CUDA_ERROR_INVALID_VALUE;
	*phGraph = graph_new();
	return *phGraph ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

API CUresult cuGraphDestroy(CUgraph hGraph)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!hGraph || hGraph->magic != MAGIC_GRAPH)
		return CUDA_ERROR_INVALID_VALUE;
	for (struct op *o = hGraph->head; o;) {
		struct op *n = o->next;
		free(o);
		o = n;
	}
	hGraph->magic = MAGIC_DEAD;
	return CUDA_SUCCESS;
}

API CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
{
	ENTRY();
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (mode > CU_STREAM_CAPTURE_MODE_RELAXED)
		return CUDA_ERROR_INVALID_VALUE;
	r = stream_resolve(c, hStream, &s);
	if (r)
		return r;
	if (!s)
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the legacy stream */
	struct CUgraph_st *g = graph_new();
	if (!g)
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&s->lock);
	if (s->capture) {
		r = CUDA_ERROR_ILLEGAL_STATE;
		free(g);
	} else {
		s->capture = g;
	}
	pthread_mutex_unlock(&s->lock);
	return r;
}
ALIAS(cuStreamBeginCapture_v2_ptsz, cuStreamBeginCapture_v2);

API CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
{
	ENTRY();
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!phGraph)
		return CUDA_ERROR_INVALID_VALUE;
	r = stream_resolve(c, hStream, &s);
	if (r)
		return r;
	if (!s)
		return CUDA_ERROR_ILLEGAL_STATE;
	pthread_mutex_lock(&s->lock);
	struct CUgraph_st *g = s->capture;
	s->capture = NULL;
	pthread_mutex_unlock(&s->lock);
	if (!g)
		return CUDA_ERROR_ILLEGAL_STATE;
	*phGraph = g;
	return CUDA_SUCCESS;
}
ALIAS(cuStreamEndCapture_ptsz, cuStreamEndCapture);

static CUresult graph_instantiate(CUgraphExec *phGraphExec, CUgraph hGraph)
{
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!phGraphExec)
		return CUDA_ERROR_INVALID_VALUE;
	if (!hGraph || hGraph->magic != MAGIC_GRAPH)
		return CUDA_ERROR_INVALID_VALUE;
	struct CUgraphExec_st *x = calloc(1, sizeof(*x));
	if (!x)
		return CUDA_ERROR_OUT_OF_MEMORY;
	x->magic = MAGIC_EXEC;
	x->nops = hGraph->nops;
	x->ops = calloc((size_t)(x->nops ? x->nops : 1), sizeof(struct op));
	if (!x->ops) {
		free(x);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	int i = 0;
	for (struct op *o = hGraph->head; o; o = o->next)
		x->ops[i++] = *o;
	*phGraphExec = x;
	return CUDA_SUCCESS;
}

API CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
					 unsigned long long flags)
{
	ENTRY();
	if (flags & ~0xfULL)
		return CUDA_ERROR_INVALID_VALUE;
	return graph_instantiate(phGraphExec, hGraph);
}

API CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
					  CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams)
{
	ENTRY();
	if (!instantiateParams)
		return CUDA_ERROR_INVALID_VALUE;
	CUresult r = graph_instantiate(phGraphExec, hGraph);
	instantiateParams->hErrNode_out = NULL;
	instantiateParams->result_out = r ? CUDA_GRAPH_INSTANTIATE_ERROR
					  : CUDA_GRAPH_INSTANTIATE_SUCCESS;
	return r;
}
ALIAS(cuGraphInstantiateWithParams_ptsz, cuGraphInstantiateWithParams);

API CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
{
	ENTRY();
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!hGraphExec || hGraphExec->magic != MAGIC_EXEC)
		return CUDA_ERROR_INVALID_VALUE;
	r = stream_resolve(c, hStream, &s);
	if (r)
		return r;
	/* One replay: every node goes to the stream in capture order. */
	for (int i = 0; i < hGraphExec->nops && !r; i++) {
		struct op *o = malloc(sizeof(*o));
		if (o)
			*o = hGraphExec->ops[i];
		r = submit(c, s, o);
	}
	return r;
}
ALIAS(cuGraphLaunch_ptsz, cuGraphLaunch);

static CUresult graph_exec_update(CUgraphExec hGraphExec, CUgraph hGraph,
				  CUgraphExecUpdateResultInfo *resultInfo)
{
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!hGraphExec || hGraphExec->magic != MAGIC_EXEC || !hGraph ||
	    hGraph->magic != MAGIC_GRAPH || !resultInfo)
		return CUDA_ERROR_INVALID_VALUE;
	resultInfo->errorNode = NULL;
	resultInfo->errorFromNode = NULL;
	CUgraphExecUpdateResult why = CU_GRAPH_EXEC_UPDATE_SUCCESS;
	if (hGraph->nops != hGraphExec->nops) {
		why = CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED;
	} else {
		int i = 0;
		for (struct op *o = hGraph->head; o && !why; o = o->next, i++) {
			if (o->kind != hGraphExec->ops[i].kind)
				why = CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED;
			else if (o->kind == OP_KERNEL && o->func->k != hGraphExec->ops[i].func->k)
				why = CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED;
		}
	}
	resultInfo->result = why;
	if (why)
		return CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE;
	int i = 0;
	for (struct op *o = hGraph->head; o; o = o->next, i++)
		hGraphExec->ops[i] = *o;
	return CUDA_SUCCESS;
}

API CUresult cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph,
				  CUgraphExecUpdateResultInfo *resultInfo)
{
	ENTRY();
	return graph_exec_update(hGraphExec, hGraph, resultInfo);
}

API CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
{
	ENTRY();
	struct CUctx_st *c;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!hGraphExec || hGraphExec->magic != MAGIC_EXEC)
		return CUDA_ERROR_INVALID_VALUE;
	hGraphExec->magic = MAGIC_DEAD;
	free(hGraphExec->ops);
	hGraphExec->ops = NULL;
	return CUDA_SUCCESS;
}

/* ------------------------------------------------------------ entry points */

/* What cuda.h's `#define cuX cuX_vN` makes a base name mean today. */
static const char *const proc_map[][2] = {
	{ "cuCtxCreate", "cuCtxCreate_v4" },
	{ "cuCtxDestroy", "cuCtxDestroy_v2" },
	{ "cuDeviceTotalMem", "cuDeviceTotalMem_v2" },
	{ "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2" },
	{ "cuDevicePrimaryCtxReset", "cuDevicePrimaryCtxReset_v2" },
	{ "cuStreamDestroy", "cuStreamDestroy_v2" },
	{ "cuStreamBeginCapture", "cuStreamBeginCapture_v2" },
	{ "cuEventDestroy", "cuEventDestroy_v2" },
	{ "cuEventElapsedTime", "cuEventElapsedTime_v2" },
	{ "cuMemAlloc", "cuMemAlloc_v2" },
	{ "cuMemAllocHost", "cuMemAllocHost_v2" },
	{ "cuMemFree", "cuMemFree_v2" },
	{ "cuMemGetInfo", "cuMemGetInfo_v2" },
	{ "cuMemcpyHtoD", "cuMemcpyHtoD_v2" },
	{ "cuMemcpyDtoH", "cuMemcpyDtoH_v2" },
	{ "cuMemcpyDtoD", "cuMemcpyDtoD_v2" },
	{ "cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2" },
	{ "cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2" },
	{ "cuMemcpyDtoDAsync", "cuMemcpyDtoDAsync_v2" },
	{ "cuMemsetD8", "cuMemsetD8_v2" },
	{ "cuMemsetD32", "cuMemsetD32_v2" },
	{ "cuMemPrefetchAsync", "cuMemPrefetchAsync_v2" },
	{ "cuMemAdvise", "cuMemAdvise_v2" },
	{ "cuGraphInstantiate", "cuGraphInstantiateWithFlags" },
	{ "cuGraphExecUpdate", "cuGraphExecUpdate_v2" },
	{ "cuGetProcAddress", "cuGetProcAddress_v2" },
};

static void *self_sym(const char *name)
{
	static void *self;
	if (!self) {
		Dl_info info;
		if (dladdr((void *)&self_sym, &info) && info.dli_fname)
			self = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
		if (!self)
			return NULL;
	}
	return dlsym(self, name);
}

static CUresult proc_address(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
			     CUdriverProcAddressQueryResult *status)
{
	if (!symbol || !pfn)
		return CUDA_ERROR_INVALID_VALUE;
	const char *name = symbol;
	for (size_t i = 0; i < sizeof(proc_map) / sizeof(proc_map[0]); i++)
		if (strcmp(proc_map[i][0], symbol) == 0)
			name = proc_map[i][1];
	void *p = NULL;
	char buf[160];
	if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) {
		snprintf(buf, sizeof(buf), "%s_ptsz", name);
		p = self_sym(buf);
		if (!p) {
			snprintf(buf, sizeof(buf), "%s_ptds", name);
			p = self_sym(buf);
		}
	}
	if (!p)
		p = self_sym(name);
	*pfn = p;
	if (status)
		*status = p ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
	(void)cudaVersion; /* the double serves every version it has */
	return p ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
				 cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
	ENTRY();
	return proc_address(symbol, pfn, cudaVersion, flags, symbolStatus);
}

API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
	ENTRY();
	return proc_address(symbol, pfn, cudaVersion, flags, NULL);
}

/* ------------------------------------------ older ABIs and rarer entries */

API CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
				CUjit_option *options, void **optionValues)
{
	ENTRY();
	if (numOptions && (!options || !optionValues))
		return CUDA_ERROR_INVALID_VALUE;
	return module_load(module, image); /* JIT options mean nothing here */
}

API CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
				       unsigned int gridDimZ, unsigned int blockDimX,
				       unsigned int blockDimY, unsigned int blockDimZ,
				       unsigned int sharedMemBytes, CUstream hStream,
				       void **kernelParams)
{
	ENTRY();
	(void)sharedMemBytes;
	return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream,
		      kernelParams, NULL);
}
ALIAS(cuLaunchCooperativeKernel_ptsz, cuLaunchCooperativeKernel);

API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool_h,
				     CUstream hStream)
{
	ENTRY();
	(void)dptr;
	(void)bytesize;
	(void)hStream;
	/* The double has no cuMemPoolCreate, so no pool handle can be valid. */
	(void)pool_h;
	return CUDA_ERROR_INVALID_VALUE;
}
ALIAS(cuMemAllocFromPoolAsync_ptsz, cuMemAllocFromPoolAsync);

API CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream)
{
	ENTRY();
	struct CUctx_st *c;
	struct CUstream_st *s;
	CUresult r = ctx_enter(&c);
	if (r)
		return r;
	if (!hGraphExec || hGraphExec->magic != MAGIC_EXEC)
		return CUDA_ERROR_INVALID_VALUE;
	return stream_resolve(c, hStream, &s); /* nothing to upload on a CPU */
}
ALIAS(cuGraphUpload_ptsz, cuGraphUpload);

/* CUDA 11 ABI of cuGraphInstantiate (the v1 symbol has the same C types). */
API CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph,
				   CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize)
{
	ENTRY();
	CUresult r = graph_instantiate(phGraphExec, hGraph);
	if (phErrorNode)
		*phErrorNode = NULL;
	if (logBuffer && bufferSize)
		logBuffer[0] = 0;
	return r;
}
ALIAS(cuGraphInstantiate, cuGraphInstantiate_v2);

/* CUDA 11 ABI of cuGraphExecUpdate. */
API CUresult cuGraphExecUpdate(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphNode *hErrorNode_out,
			       CUgraphExecUpdateResult *updateResult_out)
{
	ENTRY();
	if (!hErrorNode_out || !updateResult_out)
		return CUDA_ERROR_INVALID_VALUE;
	CUgraphExecUpdateResultInfo info;
	CUresult r = graph_exec_update(hGraphExec, hGraph, &info);
	*hErrorNode_out = info.errorNode;
	*updateResult_out = info.result;
	return r;
}
