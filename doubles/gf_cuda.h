/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * The subset of the CUDA driver API (cuda.h) that the libcuda TEST DOUBLE
 * implements and gf-infer calls. Types, values and prototypes are those of
 * cuda.h (CUDA 12.9 / 13.5) for x86-64 Linux, written out here because the
 * real header is not installed on CI machines. Symbols are the exported,
 * versioned names (cuMemAlloc_v2, not the cuMemAlloc macro), so a program
 * built against this header calls the same entry points as one built with
 * cuda.h.
 */
#ifndef GF_CUDA_H
#define GF_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError_enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_DEINITIALIZED = 4,
	CUDA_ERROR_NO_DEVICE = 100,
	CUDA_ERROR_INVALID_DEVICE = 101,
	CUDA_ERROR_INVALID_IMAGE = 200,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
	CUDA_ERROR_INVALID_PTX = 218,
	CUDA_ERROR_INVALID_HANDLE = 400,
	CUDA_ERROR_ILLEGAL_STATE = 401,
	CUDA_ERROR_NOT_FOUND = 500,
	CUDA_ERROR_NOT_READY = 600,
	CUDA_ERROR_ILLEGAL_ADDRESS = 700,
	CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
	CUDA_ERROR_LAUNCH_TIMEOUT = 702,
	CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
	CUDA_ERROR_LAUNCH_FAILED = 719,
	CUDA_ERROR_NOT_PERMITTED = 800,
	CUDA_ERROR_NOT_SUPPORTED = 801,
	CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
	CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
	CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903,
	CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE = 910,
	CUDA_ERROR_UNKNOWN = 999
} CUresult;

typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef uint64_t cuuint64_t;

typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUexecAffinityParam_st CUexecAffinityParam;
typedef struct CUctxCreateParams_st CUctxCreateParams;
typedef struct CUlaunchAttribute_st CUlaunchAttribute;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef enum CUjit_option_enum { CU_JIT_MAX_REGISTERS = 0 } CUjit_option; /* first value only */

#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)
#define CU_STREAM_DEFAULT 0x0
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DEFAULT 0x0
#define CU_MEM_ATTACH_GLOBAL 0x1
#define CU_MEM_ATTACH_HOST 0x2
#define CU_MEM_ATTACH_SINGLE 0x4
#define CU_GET_PROC_ADDRESS_DEFAULT 0
#define CU_GET_PROC_ADDRESS_LEGACY_STREAM (1ULL << 0)
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (1ULL << 1)
#define CU_LAUNCH_PARAM_END ((void *)0x00)
#define CU_LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define CU_LAUNCH_PARAM_BUFFER_SIZE ((void *)0x02)

typedef enum CUdevice_attribute_enum {
	CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1,
	CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X = 2,
	CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X = 5,
	CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10,
	CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
	CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
	CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
	CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
	CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 83,
	CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 89
} CUdevice_attribute;

typedef enum CUmem_advise_enum {
	CU_MEM_ADVISE_SET_READ_MOSTLY = 1,
	CU_MEM_ADVISE_UNSET_READ_MOSTLY = 2,
	CU_MEM_ADVISE_SET_PREFERRED_LOCATION = 3,
	CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION = 4,
	CU_MEM_ADVISE_SET_ACCESSED_BY = 5,
	CU_MEM_ADVISE_UNSET_ACCESSED_BY = 6
} CUmem_advise;

typedef enum CUmemLocationType_enum {
	CU_MEM_LOCATION_TYPE_INVALID = 0x0,
	CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
	CU_MEM_LOCATION_TYPE_HOST = 0x2,
	CU_MEM_LOCATION_TYPE_HOST_NUMA = 0x3,
	CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT = 0x4
} CUmemLocationType;

/* cuda.h has a union {int id; struct {...} localized;}; same size and ABI. */
typedef struct CUmemLocation_st {
	CUmemLocationType type;
	int id;
} CUmemLocation;

typedef enum CUstreamCaptureMode_enum {
	CU_STREAM_CAPTURE_MODE_GLOBAL = 0,
	CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1,
	CU_STREAM_CAPTURE_MODE_RELAXED = 2
} CUstreamCaptureMode;

typedef enum CUgraphExecUpdateResult_enum {
	CU_GRAPH_EXEC_UPDATE_SUCCESS = 0x0,
	CU_GRAPH_EXEC_UPDATE_ERROR = 0x1,
	CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED = 0x2,
	CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED = 0x3,
	CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED = 0x4,
	CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED = 0x5,
	CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED = 0x6
} CUgraphExecUpdateResult;

typedef struct CUgraphExecUpdateResultInfo_st {
	CUgraphExecUpdateResult result;
	CUgraphNode errorNode;
	CUgraphNode errorFromNode;
} CUgraphExecUpdateResultInfo;

typedef enum CUgraphInstantiateResult_enum {
	CUDA_GRAPH_INSTANTIATE_SUCCESS = 0,
	CUDA_GRAPH_INSTANTIATE_ERROR = 1
} CUgraphInstantiateResult;

typedef struct CUDA_GRAPH_INSTANTIATE_PARAMS_st {
	cuuint64_t flags;
	CUstream hUploadStream;
	CUgraphNode hErrNode_out;
	CUgraphInstantiateResult result_out;
} CUDA_GRAPH_INSTANTIATE_PARAMS;

typedef struct CUlaunchConfig_st {
	unsigned int gridDimX;
	unsigned int gridDimY;
	unsigned int gridDimZ;
	unsigned int blockDimX;
	unsigned int blockDimY;
	unsigned int blockDimZ;
	unsigned int sharedMemBytes;
	CUstream hStream;
	CUlaunchAttribute *attrs;
	unsigned int numAttrs;
} CUlaunchConfig;

typedef enum CUdriverProcAddressQueryResult_enum {
	CU_GET_PROC_ADDRESS_SUCCESS = 0,
	CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
	CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2
} CUdriverProcAddressQueryResult;

CUresult cuInit(unsigned int Flags);
CUresult cuDriverGetVersion(int *driverVersion);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev);

CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev);
CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *paramsArray, int numParams,
			unsigned int flags, CUdevice dev);
CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *ctxCreateParams,
			unsigned int flags, CUdevice dev);
CUresult cuCtxDestroy_v2(CUcontext ctx);
CUresult cuCtxSynchronize(void);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxGetDevice(CUdevice *device);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev);

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
CUresult cuStreamCreateWithPriority(CUstream *phStream, unsigned int flags, int priority);
CUresult cuStreamSynchronize(CUstream hStream);
CUresult cuStreamQuery(CUstream hStream);
CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags);
CUresult cuStreamDestroy_v2(CUstream hStream);
CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode);
CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);

CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags);
CUresult cuEventSynchronize(CUevent hEvent);
CUresult cuEventQuery(CUevent hEvent);
CUresult cuEventDestroy_v2(CUevent hEvent);
CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd);

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
				 CUstream hStream);
CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags);
CUresult cuMemAllocHost_v2(void **pp, size_t bytesize);
CUresult cuMemFreeHost(void *p);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream);
CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
			      CUstream hStream);
CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
			      CUstream hStream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
			      CUstream hStream);
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount, CUstream hStream);
CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N);
CUresult cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N);
CUresult cuMemPrefetchAsync(CUdeviceptr devPtr, size_t count, CUdevice dstDevice,
			    CUstream hStream);
CUresult cuMemPrefetchAsync_v2(CUdeviceptr devPtr, size_t count, CUmemLocation location,
			       unsigned int flags, CUstream hStream);
CUresult cuMemAdvise(CUdeviceptr devPtr, size_t count, CUmem_advise advice, CUdevice device);
CUresult cuMemAdvise_v2(CUdeviceptr devPtr, size_t count, CUmem_advise advice,
			CUmemLocation location);

CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
			    CUjit_option *options, void **optionValues);
CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult cuModuleUnload(CUmodule hmod);
CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
			unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
			unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
			void **kernelParams, void **extra);
CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
				   unsigned int gridDimZ, unsigned int blockDimX,
				   unsigned int blockDimY, unsigned int blockDimZ,
				   unsigned int sharedMemBytes, CUstream hStream,
				   void **kernelParams);
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
			  void **extra);

CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags);
CUresult cuGraphDestroy(CUgraph hGraph);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
				     unsigned long long flags);
CUresult cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
				      CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams);
CUresult cuGraphInstantiate_v2(CUgraphExec *phGraphExec, CUgraph hGraph,
			       CUgraphNode *phErrorNode, char *logBuffer, size_t bufferSize);
CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphExecUpdate(CUgraphExec hGraphExec, CUgraph hGraph, CUgraphNode *hErrorNode_out,
			   CUgraphExecUpdateResult *updateResult_out);
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph,
			      CUgraphExecUpdateResultInfo *resultInfo);
CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
			     CUdriverProcAddressQueryResult *symbolStatus);
CUresult cuGetErrorName(CUresult error, const char **pStr);
CUresult cuGetErrorString(CUresult error, const char **pStr);

#ifdef __cplusplus
}
#endif
#endif /* GF_CUDA_H */
