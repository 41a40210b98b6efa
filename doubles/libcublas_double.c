// SPDX-License-Identifier: GPL-2.0
/*
 * libcublas TEST DOUBLE: a CPU stand-in with cuBLAS's soname
 * (libcublas.so.13) and the handful of exports the reference service's
 * cpu-double path calls. It is NOT cuBLAS and runs no GPU code.
 *
 * Why it exists: class 8 of the fault catalogue (cuBLAS status codes) is a
 * uprobe on a cuBLAS entry point returning CUBLAS_STATUS_*. CI has no GPU
 * and no cuBLAS, so the service's cpu-double batches also run one SGEMM
 * per generated token through this library: a fault gpufault injects into
 * its cublasSgemm_v2 reaches the service as a failed batch, exactly as a
 * failed cublasSgemm_v2 of the real library does under torch on the GPU
 * host (docs/doubles.md, docs/gpu-validation.md).
 *
 * "Device" pointers are those of the libcuda double, whose pool is host
 * memory: the SGEMM reads and writes them directly, column-major, as
 * cuBLAS does. Handles are heap objects; a NULL one is
 * CUBLAS_STATUS_NOT_INITIALIZED, bad sizes CUBLAS_STATUS_INVALID_VALUE.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define API __attribute__((visibility("default"), noinline))

typedef enum {
	CUBLAS_STATUS_SUCCESS = 0,
	CUBLAS_STATUS_NOT_INITIALIZED = 1,
	CUBLAS_STATUS_ALLOC_FAILED = 3,
	CUBLAS_STATUS_INVALID_VALUE = 7,
	CUBLAS_STATUS_ARCH_MISMATCH = 8,
	CUBLAS_STATUS_MAPPING_ERROR = 11,
	CUBLAS_STATUS_EXECUTION_FAILED = 13,
	CUBLAS_STATUS_INTERNAL_ERROR = 14,
	CUBLAS_STATUS_NOT_SUPPORTED = 15,
	CUBLAS_STATUS_LICENSE_ERROR = 16,
} cublasStatus_t;

typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;

struct cublasContext {
	void *stream;
	unsigned int magic;
};
typedef struct cublasContext *cublasHandle_t;

#define HANDLE_MAGIC 0x67664342u /* "gfCB" */

static int handle_ok(cublasHandle_t h)
{
	return h && h->magic == HANDLE_MAGIC;
}

API cublasStatus_t cublasCreate_v2(cublasHandle_t *handle)
{
	cublasHandle_t h;

	if (!handle)
		return CUBLAS_STATUS_INVALID_VALUE;
	h = calloc(1, sizeof(*h));
	if (!h)
		return CUBLAS_STATUS_ALLOC_FAILED;
	h->magic = HANDLE_MAGIC;
	*handle = h;
	return CUBLAS_STATUS_SUCCESS;
}

API cublasStatus_t cublasDestroy_v2(cublasHandle_t handle)
{
	if (!handle_ok(handle))
		return CUBLAS_STATUS_NOT_INITIALIZED;
	handle->magic = 0;
	free(handle);
	return CUBLAS_STATUS_SUCCESS;
}

API cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, void *stream)
{
	if (!handle_ok(handle))
		return CUBLAS_STATUS_NOT_INITIALIZED;
	handle->stream = stream;
	return CUBLAS_STATUS_SUCCESS;
}

/* Column-major element (i, j) of op(X), X with leading dimension ld. */
static float at(const float *x, int ld, cublasOperation_t op, int i, int j)
{
	return op == CUBLAS_OP_N ? x[i + (size_t)j * ld] : x[j + (size_t)i * ld];
}

/* C = alpha * op(A) * op(B) + beta * C; op(A) is m x k, op(B) k x n. */
API cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa,
				  cublasOperation_t transb, int m, int n, int k,
				  const float *alpha, const float *A, int lda,
				  const float *B, int ldb, const float *beta, float *C,
				  int ldc)
{
	int i, j, p;

	if (!handle_ok(handle))
		return CUBLAS_STATUS_NOT_INITIALIZED;
	if (m < 0 || n < 0 || k < 0 || !alpha || !beta || ldc < (m > 1 ? m : 1) ||
	    transa > CUBLAS_OP_C || transb > CUBLAS_OP_C)
		return CUBLAS_STATUS_INVALID_VALUE;
	if (m && n && (!C || (k && (!A || !B))))
		return CUBLAS_STATUS_INVALID_VALUE;
	for (j = 0; j < n; j++)
		for (i = 0; i < m; i++) {
			float acc = 0.0f;

			for (p = 0; p < k; p++)
				acc += at(A, lda, transa, i, p) * at(B, ldb, transb, p, j);
			C[i + (size_t)j * ldc] = *alpha * acc +
				(*beta != 0.0f ? *beta * C[i + (size_t)j * ldc] : 0.0f);
		}
	return CUBLAS_STATUS_SUCCESS;
}

API const char *cublasGetStatusName(cublasStatus_t status)
{
	switch (status) {
	case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
	case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
	case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
	case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
	case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
	case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
	case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
	case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
	case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
	case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
	}
	return "CUBLAS_STATUS_UNKNOWN";
}
