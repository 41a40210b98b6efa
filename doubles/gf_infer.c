/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * gf-infer - a small inference-like loop over the CUDA driver API, the
 * target process of gpufault's tests and demo.
 *
 * N threads share one context; each has its own stream and, per step:
 *   cuMemAlloc_v2 -> cuMemcpyHtoD_v2 -> cuLaunchKernel(gf_axpy) ->
 *   cuStreamSynchronize -> cuMemcpyDtoH_v2 -> verify -> cuMemFree_v2
 * Every CUDA error is reported on stdout (one line, flushed) and the loop
 * goes on (or stops with --exit-on-error). Exit status: 0 when every call
 * succeeded and every result was right, 1 otherwise, 2 for bad usage.
 *
 * Built against the libcuda TEST DOUBLE (RUNPATH $ORIGIN: the double beside it); the
 * kernels are PTX, so the same binary runs on a real GPU with
 * LD_LIBRARY_PATH pointing at the real driver's directory.
 *
 * Usage: gf-infer [--threads N] [--steps N] [--alloc-mib N] [--wait]
 *                 [--exit-on-error] [--kernel-us N] [--trap-at STEP]
 */
#define _GNU_SOURCE
#include "gf_cuda.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* PTX ISA 6.3 / sm_75: JIT-compiled by any driver since CUDA 10 for
 * Turing and newer GPUs. The test double reads the .entry names. */
static const char ptx[] =
	".version 6.3\n"
	".target sm_75\n"
	".address_size 64\n"
	"\n"
	".visible .entry gf_fill(\n"
	"\t.param .u64 gf_fill_n,\n"
	"\t.param .u32 gf_fill_v,\n"
	"\t.param .u64 gf_fill_y\n"
	")\n"
	"{\n"
	"\t.reg .pred %p<2>;\n"
	"\t.reg .b32 %r<5>;\n"
	"\t.reg .b64 %rd<8>;\n"
	"\tld.param.u64 %rd1, [gf_fill_n];\n"
	"\tld.param.u32 %r1, [gf_fill_v];\n"
	"\tld.param.u64 %rd2, [gf_fill_y];\n"
	"\tmov.u32 %r2, %ctaid.x;\n"
	"\tmov.u32 %r3, %ntid.x;\n"
	"\tmov.u32 %r4, %tid.x;\n"
	"\tmul.wide.u32 %rd3, %r2, %r3;\n"
	"\tcvt.u64.u32 %rd4, %r4;\n"
	"\tadd.s64 %rd5, %rd3, %rd4;\n"
	"\tsetp.ge.u64 %p1, %rd5, %rd1;\n"
	"\t@%p1 bra $L_fill_done;\n"
	"\tcvta.to.global.u64 %rd6, %rd2;\n"
	"\tshl.b64 %rd7, %rd5, 2;\n"
	"\tadd.s64 %rd6, %rd6, %rd7;\n"
	"\tst.global.u32 [%rd6], %r1;\n"
	"$L_fill_done:\n"
	"\tret;\n"
	"}\n"
	"\n"
	".visible .entry gf_axpy(\n"
	"\t.param .u64 gf_axpy_n,\n"
	"\t.param .u32 gf_axpy_a,\n"
	"\t.param .u64 gf_axpy_x,\n"
	"\t.param .u64 gf_axpy_y\n"
	")\n"
	"{\n"
	"\t.reg .pred %p<2>;\n"
	"\t.reg .b32 %r<8>;\n"
	"\t.reg .b64 %rd<12>;\n"
	"\tld.param.u64 %rd1, [gf_axpy_n];\n"
	"\tld.param.u32 %r1, [gf_axpy_a];\n"
	"\tld.param.u64 %rd2, [gf_axpy_x];\n"
	"\tld.param.u64 %rd3, [gf_axpy_y];\n"
	"\tmov.u32 %r2, %ctaid.x;\n"
	"\tmov.u32 %r3, %ntid.x;\n"
	"\tmov.u32 %r4, %tid.x;\n"
	"\tmul.wide.u32 %rd4, %r2, %r3;\n"
	"\tcvt.u64.u32 %rd5, %r4;\n"
	"\tadd.s64 %rd6, %rd4, %rd5;\n"
	"\tsetp.ge.u64 %p1, %rd6, %rd1;\n"
	"\t@%p1 bra $L_axpy_done;\n"
	"\tcvta.to.global.u64 %rd7, %rd2;\n"
	"\tcvta.to.global.u64 %rd8, %rd3;\n"
	"\tshl.b64 %rd9, %rd6, 2;\n"
	"\tadd.s64 %rd10, %rd7, %rd9;\n"
	"\tadd.s64 %rd11, %rd8, %rd9;\n"
	"\tld.global.u32 %r5, [%rd10];\n"
	"\tld.global.u32 %r6, [%rd11];\n"
	"\tmad.lo.u32 %r7, %r5, %r1, %r6;\n"
	"\tst.global.u32 [%rd11], %r7;\n"
	"$L_axpy_done:\n"
	"\tret;\n"
	"}\n"
	"\n"
	".visible .entry gf_checksum(\n"
	"\t.param .u64 gf_checksum_n,\n"
	"\t.param .u64 gf_checksum_x,\n"
	"\t.param .u64 gf_checksum_out\n"
	")\n"
	"{\n"
	"\t.reg .pred %p<2>;\n"
	"\t.reg .b32 %r<5>;\n"
	"\t.reg .b64 %rd<11>;\n"
	"\tld.param.u64 %rd1, [gf_checksum_n];\n"
	"\tld.param.u64 %rd2, [gf_checksum_x];\n"
	"\tld.param.u64 %rd3, [gf_checksum_out];\n"
	"\tmov.u32 %r2, %ctaid.x;\n"
	"\tmov.u32 %r3, %ntid.x;\n"
	"\tmov.u32 %r4, %tid.x;\n"
	"\tmul.wide.u32 %rd4, %r2, %r3;\n"
	"\tcvt.u64.u32 %rd5, %r4;\n"
	"\tadd.s64 %rd6, %rd4, %rd5;\n"
	"\tsetp.ge.u64 %p1, %rd6, %rd1;\n"
	"\t@%p1 bra $L_sum_done;\n"
	"\tcvta.to.global.u64 %rd7, %rd2;\n"
	"\tshl.b64 %rd8, %rd6, 2;\n"
	"\tadd.s64 %rd7, %rd7, %rd8;\n"
	"\tld.global.u32 %r1, [%rd7];\n"
	"\tcvt.u64.u32 %rd9, %r1;\n"
	"\tcvta.to.global.u64 %rd10, %rd3;\n"
	"\tatom.global.add.u64 %rd9, [%rd10], %rd9;\n"
	"$L_sum_done:\n"
	"\tret;\n"
	"}\n"
	"\n"
	".visible .entry gf_sleep(\n"
	"\t.param .u64 gf_sleep_usec\n"
	")\n"
	"{\n"
	"\t.reg .pred %p<2>;\n"
	"\t.reg .b64 %rd<6>;\n"
	"\tld.param.u64 %rd1, [gf_sleep_usec];\n"
	"\tmul.lo.u64 %rd2, %rd1, 1000;\n"
	"\tmov.u64 %rd3, %globaltimer;\n"
	"$L_sleep_loop:\n"
	"\tnanosleep.u32 1000;\n"
	"\tmov.u64 %rd4, %globaltimer;\n"
	"\tsub.s64 %rd5, %rd4, %rd3;\n"
	"\tsetp.lt.u64 %p1, %rd5, %rd2;\n"
	"\t@%p1 bra $L_sleep_loop;\n"
	"\tret;\n"
	"}\n"
	"\n"
	".visible .entry gf_trap()\n"
	"{\n"
	"\ttrap;\n"
	"\tret;\n"
	"}\n";

struct opts {
	long threads;
	long steps; /* per thread; 0 = until stdin closes */
	long alloc_mib;
	long kernel_us;
	long trap_at;
	int wait;
	int exit_on_error;
};

static struct opts opt = { .threads = 1, .steps = 10, .alloc_mib = 4 };
static CUcontext g_ctx;
static CUfunction g_axpy, g_sleep, g_trap;
static atomic_long n_steps, n_errors, n_mismatches;
static atomic_int g_stop;

static void summary(void)
{
	printf("summary steps=%ld errors=%ld mismatches=%ld\n", atomic_load(&n_steps),
	       atomic_load(&n_errors), atomic_load(&n_mismatches));
	fflush(stdout);
}

static const char *cu_name(CUresult r)
{
	const char *s = NULL;
	if (cuGetErrorName(r, &s) != CUDA_SUCCESS || !s)
		return "CUDA_ERROR_UNRECOGNIZED";
	return s;
}

static void report(long step, const char *fn, CUresult r)
{
	printf("step %ld tid %ld: %s -> %s (%d)\n", step, (long)syscall(SYS_gettid), fn,
	       cu_name(r), (int)r);
	atomic_fetch_add(&n_errors, 1);
	if (opt.exit_on_error) {
		summary();
		_exit(1);
	}
}

/* The function name alone (text before the '('), for the report line. */
static const char *fname(const char *call, char *buf, size_t len)
{
	size_t n = strcspn(call, "(");
	if (n >= len)
		n = len - 1;
	memcpy(buf, call, n);
	buf[n] = 0;
	return buf;
}

/* Runs a CUDA call; on failure reports it and leaves the step. */
#define CK(step, call)                                                                   \
	do {                                                                             \
		CUresult r_ = (call);                                                    \
		if (r_ != CUDA_SUCCESS) {                                                \
			char b_[64];                                                     \
			report(step, fname(#call, b_, sizeof(b_)), r_);                  \
			goto out;                                                        \
		}                                                                        \
	} while (0)

static uint32_t pattern(uint32_t seed, uint64_t i)
{
	uint32_t x = seed ^ (uint32_t)(i * 0x9E3779B1u);
	x ^= x >> 15;
	x *= 0x2C1B3C6Du;
	return x ^ (x >> 12);
}

static int one_step(long step, long tid_idx, CUstream stream, uint32_t *host, uint32_t *back)
{
	size_t bytes = (size_t)opt.alloc_mib << 20;
	unsigned long long n = bytes / 4;
	uint32_t seed = (uint32_t)(tid_idx * 7919 + step * 104729);
	uint32_t a = 3 + (uint32_t)(step & 7);
	CUdeviceptr d = 0;
	int ok = 0;

	for (unsigned long long i = 0; i < n; i++)
		host[i] = pattern(seed, i);
	CK(step, cuMemAlloc_v2(&d, bytes));
	CK(step, cuMemcpyHtoD_v2(d, host, bytes));
	if (opt.trap_at == step) {
		CK(step, cuLaunchKernel(g_trap, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL));
	}
	if (opt.kernel_us > 0) {
		unsigned long long us = (unsigned long long)opt.kernel_us;
		void *sp[] = { &us };
		CK(step, cuLaunchKernel(g_sleep, 1, 1, 1, 1, 1, 1, 0, stream, sp, NULL));
	}
	/* In place: y = a*x + y with x == y gives (a+1) * x. */
	void *params[] = { &n, &a, &d, &d };
	unsigned int grid = (unsigned int)((n + 255) / 256);
	CK(step, cuLaunchKernel(g_axpy, grid, 1, 1, 256, 1, 1, 0, stream, params, NULL));
	CK(step, cuStreamSynchronize(stream));
	CK(step, cuMemcpyDtoH_v2(back, d, bytes));
	for (unsigned long long i = 0; i < n; i++) {
		uint32_t want = (a + 1) * host[i];
		if (back[i] != want) {
			printf("step %ld: result mismatch (tid %ld, element %llu of %llu: "
			       "got %#x want %#x)\n",
			       step, (long)syscall(SYS_gettid), i, n, back[i], want);
			atomic_fetch_add(&n_mismatches, 1);
			if (opt.exit_on_error) {
				summary();
				_exit(1);
			}
			goto out;
		}
	}
	ok = 1;
out:
	if (d) {
		CUresult r = cuMemFree_v2(d);
		if (r != CUDA_SUCCESS) {
			report(step, "cuMemFree_v2", r);
			ok = 0;
		}
	}
	return ok;
}

static void *worker(void *arg)
{
	long idx = (long)(intptr_t)arg;
	size_t bytes = (size_t)opt.alloc_mib << 20;
	uint32_t *host = malloc(bytes), *back = malloc(bytes);
	CUstream stream = NULL;
	CUresult r;

	if (!host || !back) {
		printf("thread %ld: out of host memory for --alloc-mib %ld\n", idx, opt.alloc_mib);
		atomic_fetch_add(&n_errors, 1);
		goto done;
	}
	r = cuCtxSetCurrent(g_ctx);
	if (r == CUDA_SUCCESS)
		r = cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
	if (r != CUDA_SUCCESS) {
		report(0, stream ? "cuStreamCreate" : "cuCtxSetCurrent", r);
		goto done;
	}
	for (long step = 1; opt.steps == 0 || step <= opt.steps; step++) {
		if (atomic_load(&g_stop))
			break;
		one_step(step, idx, stream, host, back);
		atomic_fetch_add(&n_steps, 1);
	}
	if (stream)
		cuStreamDestroy_v2(stream);
done:
	free(host);
	free(back);
	return NULL;
}

static void usage_error(const char *msg, const char *arg)
{
	fprintf(stderr, "gf-infer: %s%s%s; see the header of doubles/gf_infer.c for usage\n", msg,
		arg ? ": " : "", arg ? arg : "");
	exit(2);
}

static long num_arg(int argc, char **argv, int *i, long lo, long hi)
{
	if (*i + 1 >= argc)
		usage_error("missing value for", argv[*i]);
	char *end;
	errno = 0;
	long v = strtol(argv[*i + 1], &end, 10);
	if (errno || *end || end == argv[*i + 1] || v < lo || v > hi) {
		char msg[96];
		snprintf(msg, sizeof(msg), "%s takes a whole number from %ld to %ld", argv[*i], lo,
			 hi);
		usage_error(msg, argv[*i + 1]);
	}
	(*i)++;
	return v;
}

static void setup_fail(const char *fn, CUresult r)
{
	printf("setup: %s -> %s (%d)\n", fn, cu_name(r), (int)r);
	atomic_fetch_add(&n_errors, 1);
	summary();
	exit(1);
}

int main(int argc, char **argv)
{
	/* One line at a time even into a pipe: tests read it as it happens. */
	setvbuf(stdout, NULL, _IOLBF, 0);
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--threads"))
			opt.threads = num_arg(argc, argv, &i, 1, 256);
		else if (!strcmp(a, "--steps"))
			opt.steps = num_arg(argc, argv, &i, 0, LONG_MAX);
		else if (!strcmp(a, "--alloc-mib"))
			opt.alloc_mib = num_arg(argc, argv, &i, 1, 1 << 20);
		else if (!strcmp(a, "--kernel-us"))
			opt.kernel_us = num_arg(argc, argv, &i, 0, 60000000);
		else if (!strcmp(a, "--trap-at"))
			opt.trap_at = num_arg(argc, argv, &i, 1, LONG_MAX);
		else if (!strcmp(a, "--wait"))
			opt.wait = 1;
		else if (!strcmp(a, "--exit-on-error"))
			opt.exit_on_error = 1;
		else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			printf("usage: gf-infer [--threads N] [--steps N (0: until stdin closes)] "
			       "[--alloc-mib N] [--wait] [--exit-on-error] [--kernel-us N] "
			       "[--trap-at STEP]\n");
			return 0;
		} else
			usage_error("unknown option", a);
	}

	CUresult r;
	CUdevice dev;
	CUmodule mod;
	if ((r = cuInit(0)))
		setup_fail("cuInit", r);
	if ((r = cuDeviceGet(&dev, 0)))
		setup_fail("cuDeviceGet", r);
	if ((r = cuCtxCreate_v2(&g_ctx, 0, dev)))
		setup_fail("cuCtxCreate_v2", r);
	if ((r = cuModuleLoadData(&mod, ptx)))
		setup_fail("cuModuleLoadData", r);
	if ((r = cuModuleGetFunction(&g_axpy, mod, "gf_axpy")))
		setup_fail("cuModuleGetFunction", r);
	if ((r = cuModuleGetFunction(&g_sleep, mod, "gf_sleep")))
		setup_fail("cuModuleGetFunction", r);
	if ((r = cuModuleGetFunction(&g_trap, mod, "gf_trap")))
		setup_fail("cuModuleGetFunction", r);

	char line[256];
	if (opt.wait) {
		/* Tests attach probes now, then write a line to start the loop. */
		printf("ready pid=%ld\n", (long)getpid());
		if (!fgets(line, sizeof(line), stdin) && opt.steps == 0)
			atomic_store(&g_stop, 1);
	}

	pthread_t *thr = calloc((size_t)opt.threads, sizeof(*thr));
	if (!thr)
		setup_fail("calloc", CUDA_ERROR_OUT_OF_MEMORY);
	for (long t = 0; t < opt.threads; t++)
		if (pthread_create(&thr[t], NULL, worker, (void *)(intptr_t)t) != 0)
			setup_fail("pthread_create", CUDA_ERROR_OUT_OF_MEMORY);
	if (opt.steps == 0) {
		/* Run until stdin closes. */
		while (fgets(line, sizeof(line), stdin))
			;
		atomic_store(&g_stop, 1);
	}
	for (long t = 0; t < opt.threads; t++)
		pthread_join(thr[t], NULL);
	free(thr);
	cuCtxDestroy_v2(g_ctx);
	summary();
	return atomic_load(&n_errors) || atomic_load(&n_mismatches) ? 1 : 0;
}
