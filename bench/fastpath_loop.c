// Loop for bench/bench_fastpath.py: times each cuMemAlloc_v2 of the libcuda
// TEST DOUBLE (pyctl/data/doubles) from inside the process.
// Usage: fastpath_loop SHAPE(plain|server) THREADS N [fiu]
//   plain:  each thread calls in a tight loop
//   server: each thread "handles a request" (~2 us of work) per call
//   fiu:    calls go through a libfiu point (fiu_return_on) enabled always
// Prints "ready PID", waits for a line on stdin, runs, prints one line
// (then lives until stdin's EOF):
//   n=.. p50=.. p99=.. max=.. failed=..   (ns; failed = calls that returned 2)
// GF_LOOP_SCHED=1 adds what the scheduler did inside each timed call
// (getrusage(RUSAGE_THREAD) around it, outside the clock pair):
//   preempted=.. (calls with an involuntary context switch inside)
//   voluntary=.. (calls that slept inside: a futex, a wait)
//   p99_unpreempted=.. p50_preempted=.. (ns)
#define _GNU_SOURCE
#define FIU_ENABLE 1
#include <fiu.h>
#include <fiu-control.h>
#include <fiu-local.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned flags);
CUresult cuDeviceGet(int *dev, int ordinal);
CUresult cuCtxCreate_v2(void **ctx, unsigned flags, int dev);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);

static int server, use_fiu, sched_diag;
static uint8_t *pre, *vol;	/* per call: preempted, slept (GF_LOOP_SCHED) */
static long n_calls;
static uint64_t *lat;
static long failed;
static void *ctx;

static uint64_t now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000ull + ts.tv_nsec;
}

__attribute__((noinline)) static CUresult alloc_fiu(CUdeviceptr *p, size_t n)
{
	fiu_return_on("gf/alloc", 2);
	return cuMemAlloc_v2(p, n);
}

extern CUresult cuCtxSetCurrent(void *ctx);

static void *worker(void *arg)
{
	uint64_t *l = lat + (long)arg * n_calls;
	long f = 0;
	cuCtxSetCurrent(ctx);
	for (long i = 0; i < n_calls; i++) {
		CUdeviceptr p = 0;
		if (server) {	/* the request's own work, ~2 us */
			uint64_t w = now() + 2000;
			while (now() < w)
				;
		}
		struct rusage r0, r1;
		if (sched_diag)
			getrusage(RUSAGE_THREAD, &r0);
		uint64_t t0 = now();
		CUresult r = use_fiu ? alloc_fiu(&p, 64) : cuMemAlloc_v2(&p, 64);
		l[i] = now() - t0;
		if (sched_diag) {
			getrusage(RUSAGE_THREAD, &r1);
			long k = l - lat + i;
			pre[k] = r1.ru_nivcsw != r0.ru_nivcsw;
			vol[k] = r1.ru_nvcsw != r0.ru_nvcsw;
		}
		if (r == 2)
			f++;
		else if (r == 0)
			cuMemFree_v2(p);
	}
	__atomic_add_fetch(&failed, f, __ATOMIC_RELAXED);
	return NULL;
}

static int cmp(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
	int dev;
	if (argc < 4)
		return 2;
	server = !strcmp(argv[1], "server");
	int nt = atoi(argv[2]);
	n_calls = atol(argv[3]);
	use_fiu = argc > 4 && !strcmp(argv[4], "fiu");
	if (use_fiu) {
		fiu_init(0);
		fiu_enable("gf/alloc", 1, NULL, 0);
	}
	cuInit(0);
	cuDeviceGet(&dev, 0);
	cuCtxCreate_v2(&ctx, 0, dev);
	lat = calloc(nt * n_calls, sizeof(*lat));
	sched_diag = getenv("GF_LOOP_SCHED") && !strcmp(getenv("GF_LOOP_SCHED"), "1");
	pre = calloc(nt * n_calls, 1);
	vol = calloc(nt * n_calls, 1);
	printf("ready %d\n", getpid());
	fflush(stdout);
	char line[64];
	if (!fgets(line, sizeof line, stdin))
		return 1;
	pthread_t th[64];
	for (long t = 0; t < nt; t++)
		pthread_create(&th[t], NULL, worker, (void *)t);
	for (int t = 0; t < nt; t++)
		pthread_join(th[t], NULL);
	long n = nt * n_calls;
	long npre = 0, nvol = 0, nclean = 0, nhit = 0;
	uint64_t *clean = calloc(n, sizeof(*clean)), *hit = calloc(n, sizeof(*hit));
	for (long k = 0; k < n; k++) {
		npre += pre[k];
		nvol += vol[k];
		if (pre[k] || vol[k])
			hit[nhit++] = lat[k];
		else
			clean[nclean++] = lat[k];
	}
	qsort(lat, n, sizeof(*lat), cmp);
	printf("n=%ld p50=%lu p99=%lu max=%lu failed=%ld", n, lat[n / 2], lat[n * 99 / 100],
	       lat[n - 1], failed);
	if (sched_diag) {
		qsort(clean, nclean, sizeof(*clean), cmp);
		qsort(hit, nhit, sizeof(*hit), cmp);
		printf(" preempted=%ld voluntary=%ld p99_unpreempted=%lu p50_preempted=%lu", npre,
		       nvol, nclean ? clean[nclean * 99 / 100] : 0, nhit ? hit[nhit / 2] : 0);
	}
	printf("\n");
	fflush(stdout);
	while (fgets(line, sizeof line, stdin))	/* alive until the controller detached */
		;
	return 0;
}
