"""ctypes bindings to the libcuda and libcublas TEST DOUBLES
(pyctl/data/doubles/libcuda.so.1, libcublas.so.13).

The double is a CPU stand-in with libcuda's soname and exports (see
doubles/libcuda_double.c); it is NOT the CUDA driver. The service's
`cpu-double` mode drives it the way gf-infer (doubles/gf_infer.c) does, so
a fault gpufault injects into the double's driver API (for example
`cuMemAlloc_v2` returning CUDA_ERROR_OUT_OF_MEMORY) reaches the service as
a failed CUDA call of a batch.

The double keeps the current context per thread, as the driver does: one
DoubleDriver belongs to the thread that calls `open()` (the worker).
"""

from __future__ import annotations

import ctypes as C
from pathlib import Path

from pyctl import paths

# The double reads the kernel names from PTX .entry lines (gf_fill is one
# of its built-in kernels: y[i] = v for i < n).
PTX = b"""
.version 6.3
.target sm_75
.address_size 64
.visible .entry gf_fill(.param .u64 gf_fill_n, .param .u32 gf_fill_v, .param .u64 gf_fill_y)
{ ret; }
"""

# Errors after which the double's context stays poisoned (as the driver's
# does) until it is destroyed: the next batch opens a new one.
STICKY = {700, 714, 715, 716, 717, 718, 719}

CU_STREAM_NON_BLOCKING = 1
CU_STREAM_CAPTURE_MODE_GLOBAL = 0
CU_MEM_ATTACH_GLOBAL = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemLocation(C.Structure):
    """cuda.h's CUmemLocation, passed by value to cuMemPrefetchAsync_v2."""

    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class CudaCallError(Exception):
    """A CUDA driver call of the double returned an error code."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} -> {name} ({code}) [libcuda test double]")
        self.call, self.code, self.name = call, code, name


def double_path() -> Path:
    return paths.DOUBLE_LIBCUDA


class CublasDouble:
    """The libcublas TEST DOUBLE (pyctl/data/doubles/libcublas.so.13, a CPU
    SGEMM with cuBLAS's soname; NOT cuBLAS): per generated token the batch
    runs one small cublasSgemm_v2 over the libcuda double's memory, so a
    cuBLAS status gpufault injects there (class 8) fails the batch as a
    failed cuBLAS GEMM does under torch on the GPU host."""

    N = 8  # an 8 x 8 x 8 SGEMM: A, B and C take 3 x 256 bytes of the batch's buffer

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else paths.DOUBLE_LIBCUBLAS
        if not self.path.exists():
            raise FileNotFoundError(paths.hint(self.path))
        L = self.lib = C.CDLL(str(self.path))
        vp, i, fp = C.c_void_p, C.c_int, C.POINTER(C.c_float)
        L.cublasCreate_v2.argtypes = [C.POINTER(vp)]
        L.cublasDestroy_v2.argtypes = [vp]
        L.cublasSgemm_v2.argtypes = [vp, i, i, i, i, i, fp, C.c_uint64, i, C.c_uint64, i, fp,
                                     C.c_uint64, i]  # fmt: skip
        for fn in (L.cublasCreate_v2, L.cublasDestroy_v2, L.cublasSgemm_v2):
            fn.restype = C.c_int
        L.cublasGetStatusName.argtypes = [C.c_int]
        L.cublasGetStatusName.restype = C.c_char_p
        self.handle = C.c_void_p()
        self._ck("cublasCreate_v2", L.cublasCreate_v2(C.byref(self.handle)))
        self.one, self.zero = C.c_float(1.0), C.c_float(0.0)

    def _ck(self, call: str, code: int) -> None:
        if code != 0:
            name = (self.lib.cublasGetStatusName(code) or b"").decode() or f"CUBLAS_STATUS_{code}"
            raise CudaCallError(call, code, name)

    def sgemm(self, dptr: int) -> None:
        """C = A @ B on the first 768 bytes of an allocation of the double."""
        n, step = self.N, self.N * self.N * 4
        self._ck(
            "cublasSgemm_v2",
            self.lib.cublasSgemm_v2(self.handle, 0, 0, n, n, n, C.byref(self.one), dptr, n,
                                    dptr + step, n, C.byref(self.zero), dptr + 2 * step, n),
        )  # fmt: skip

    def close(self) -> None:
        if self.handle.value:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = C.c_void_p()


class DoubleDriver:
    """Just the calls a batch needs: alloc, launch, synchronize, free; and
    for --cuda-mode graph / managed: a stream, stream capture into a graph,
    its replay, managed allocation and prefetch."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else double_path()
        if not self.path.exists():
            raise FileNotFoundError(paths.hint(self.path))
        self.lib = C.CDLL(str(self.path))
        L = self.lib
        u64, vp, sz = C.c_uint64, C.c_void_p, C.c_size_t
        sigs: dict[str, list[object]] = {
            "cuInit": [C.c_uint],
            "cuDeviceGet": [C.POINTER(C.c_int), C.c_int],
            "cuCtxCreate_v2": [C.POINTER(vp), C.c_uint, C.c_int],
            "cuCtxDestroy_v2": [vp],
            "cuCtxSetCurrent": [vp],
            "cuCtxSynchronize": [],
            "cuModuleLoadData": [C.POINTER(vp), C.c_char_p],
            "cuModuleGetFunction": [C.POINTER(vp), vp, C.c_char_p],
            "cuMemAlloc_v2": [C.POINTER(u64), sz],
            "cuMemFree_v2": [u64],
            "cuMemGetInfo_v2": [C.POINTER(sz), C.POINTER(sz)],
            "cuLaunchKernel": [
                vp,
                C.c_uint,
                C.c_uint,
                C.c_uint,
                C.c_uint,
                C.c_uint,
                C.c_uint,
                C.c_uint,
                vp,
                C.POINTER(vp),
                C.POINTER(vp),
            ],
            "cuGetErrorName": [C.c_int, C.POINTER(C.c_char_p)],
            "cuStreamCreate": [C.POINTER(vp), C.c_uint],
            "cuStreamSynchronize": [vp],
            "cuStreamBeginCapture_v2": [vp, C.c_int],
            "cuStreamEndCapture": [vp, C.POINTER(vp)],
            "cuGraphInstantiateWithFlags": [C.POINTER(vp), vp, C.c_ulonglong],
            "cuGraphDestroy": [vp],
            "cuGraphLaunch": [vp, vp],
            "cuGraphExecDestroy": [vp],
            "cuMemAllocManaged": [C.POINTER(u64), sz, C.c_uint],
            "cuMemPrefetchAsync_v2": [u64, sz, CUmemLocation, C.c_uint, vp],
        }
        for name, args in sigs.items():
            fn = getattr(L, name)
            fn.argtypes = args
            fn.restype = C.c_int
        self.ctx = C.c_void_p()
        self.fill = C.c_void_p()
        self.stream = C.c_void_p()  # created on demand: capture needs a non-NULL stream
        self.poisoned = False
        # +1 per open(): handles of an older context (stream, graph, memory) are dead.
        self.generation = 0

    def error_name(self, code: int) -> str:
        s = C.c_char_p()
        if self.lib.cuGetErrorName(code, C.byref(s)) == 0 and s.value:
            return s.value.decode()
        return f"CUDA_ERROR_{code}"

    def _ck(self, call: str, code: int) -> None:
        if code != 0:
            if code in STICKY:
                self.poisoned = True
            raise CudaCallError(call, code, self.error_name(code))

    def open(self) -> None:
        """cuInit, a context current in this thread, the gf_fill kernel."""
        self._ck("cuInit", self.lib.cuInit(0))
        dev = C.c_int()
        self._ck("cuDeviceGet", self.lib.cuDeviceGet(C.byref(dev), 0))
        self._ck("cuCtxCreate_v2", self.lib.cuCtxCreate_v2(C.byref(self.ctx), 0, dev.value))
        mod = C.c_void_p()
        self._ck("cuModuleLoadData", self.lib.cuModuleLoadData(C.byref(mod), PTX))
        self._ck(
            "cuModuleGetFunction", self.lib.cuModuleGetFunction(C.byref(self.fill), mod, b"gf_fill")
        )
        self.poisoned = False
        self.generation += 1

    def reopen_if_poisoned(self) -> None:
        if self.poisoned:
            self.close()
            self.open()

    def close(self) -> None:
        if self.ctx.value:
            self.lib.cuCtxDestroy_v2(self.ctx)  # best effort: the process is leaving
            self.ctx = C.c_void_p()
            self.stream = C.c_void_p()  # destroyed with its context

    def alloc(self, nbytes: int) -> int:
        d = C.c_uint64()
        self._ck("cuMemAlloc_v2", self.lib.cuMemAlloc_v2(C.byref(d), nbytes))
        return d.value

    def free(self, dptr: int) -> None:
        self._ck("cuMemFree_v2", self.lib.cuMemFree_v2(dptr))

    def launch_fill(self, dptr: int, nbytes: int, value: int, stream: int | None = None) -> None:
        """gf_fill over the allocation, on the NULL stream (synchronous in
        the double) unless `stream` is given."""
        n = C.c_uint64(nbytes // 4)
        v = C.c_uint32(value & 0xFFFFFFFF)
        y = C.c_uint64(dptr)
        params = (C.c_void_p * 3)(*(C.cast(C.pointer(p), C.c_void_p) for p in (n, v, y)))
        grid = max(1, (n.value + 255) // 256)
        self._ck(
            "cuLaunchKernel",
            self.lib.cuLaunchKernel(self.fill, grid, 1, 1, 256, 1, 1, 0, stream, params, None),
        )

    def synchronize(self) -> None:
        self._ck("cuCtxSynchronize", self.lib.cuCtxSynchronize())

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the double's pool, from the owning thread."""
        free, total = C.c_size_t(), C.c_size_t()
        self._ck("cuMemGetInfo_v2", self.lib.cuMemGetInfo_v2(C.byref(free), C.byref(total)))
        return free.value, total.value

    # ---- --cuda-mode graph ------------------------------------------------------
    def ensure_stream(self) -> int:
        if not self.stream.value:
            self._ck(
                "cuStreamCreate",
                self.lib.cuStreamCreate(C.byref(self.stream), CU_STREAM_NON_BLOCKING),
            )
        return int(self.stream.value or 0)

    def capture_fill_graph(self, dptr: int, nbytes: int) -> int:
        """A graph of one token's work (gf_fill over dptr), made by stream
        capture as torch.cuda.graph does, instantiated; returns the CUgraphExec."""
        s = self.ensure_stream()
        self._ck(
            "cuStreamBeginCapture_v2",
            self.lib.cuStreamBeginCapture_v2(s, CU_STREAM_CAPTURE_MODE_GLOBAL),
        )
        graph = C.c_void_p()
        try:
            self.launch_fill(dptr, nbytes, 1, stream=s)
        finally:
            # Always end the capture, or the stream stays in capture mode.
            ended = self.lib.cuStreamEndCapture(s, C.byref(graph))
        self._ck("cuStreamEndCapture", ended)
        exe = C.c_void_p()
        try:
            self._ck(
                "cuGraphInstantiateWithFlags",
                self.lib.cuGraphInstantiateWithFlags(C.byref(exe), graph, 0),
            )
        finally:
            self.lib.cuGraphDestroy(graph)  # the exec keeps its own copy of the nodes
        return int(exe.value or 0)

    def graph_launch(self, exe: int) -> None:
        """One replay on the stream, waited for (so its errors are this step's)."""
        self._ck("cuGraphLaunch", self.lib.cuGraphLaunch(exe, self.stream))
        self._ck("cuStreamSynchronize", self.lib.cuStreamSynchronize(self.stream))

    def graph_destroy(self, exe: int) -> None:
        self.lib.cuGraphExecDestroy(exe)  # best effort: it may be the failing one

    # ---- --cuda-mode managed ----------------------------------------------------
    def alloc_managed(self, nbytes: int) -> int:
        d = C.c_uint64()
        self._ck(
            "cuMemAllocManaged",
            self.lib.cuMemAllocManaged(C.byref(d), nbytes, CU_MEM_ATTACH_GLOBAL),
        )
        return d.value

    def prefetch(self, dptr: int, nbytes: int) -> None:
        """Migrate managed memory to device 0 ahead of the kernels (a hint)."""
        loc = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, 0)
        self._ck(
            "cuMemPrefetchAsync_v2", self.lib.cuMemPrefetchAsync_v2(dptr, nbytes, loc, 0, None)
        )
