"""Drive a libcuda (the TEST DOUBLE, or a real one) through ctypes and print
what each call returned, as one JSON object on stdout.

    python3 doubles/ctypes_probe.py LIBCUDA SCENARIO

Scenarios run in a fresh process each (tests/test_double.py starts them),
so driver state such as a sticky error never leaks between them.
"""

from __future__ import annotations

import ctypes as C
import json
import sys
from collections.abc import Callable

PTX = b"""
.version 6.3
.target sm_75
.address_size 64
.visible .entry gf_fill(.param .u64 n, .param .u32 v, .param .u64 y) { ret; }
.visible .entry gf_axpy(.param .u64 n, .param .u32 a, .param .u64 x, .param .u64 y) { ret; }
.visible .entry gf_mystery() { ret; }
"""

CU_STREAM_NON_BLOCKING = 1
CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 2


class Drv:
    """Thin ctypes layer: every call returns the CUresult as an int."""

    def __init__(self, path: str) -> None:
        self.lib = C.CDLL(path)

    def __getattr__(self, name: str) -> Callable[..., int]:
        fn = getattr(self.lib, name)
        fn.restype = C.c_int
        return fn  # type: ignore[no-any-return]

    # helpers ----------------------------------------------------------
    def setup(self) -> C.c_void_p:
        assert self.cuInit(0) == 0
        ctx = C.c_void_p()
        assert self.cuCtxCreate_v2(C.byref(ctx), 0, 0) == 0
        return ctx

    def alloc(self, n: int) -> tuple[int, int]:
        d = C.c_uint64()
        r = self.cuMemAlloc_v2(C.byref(d), C.c_size_t(n))
        return r, d.value

    def function(self, name: bytes) -> tuple[int, C.c_void_p]:
        mod = C.c_void_p()
        assert self.cuModuleLoadData(C.byref(mod), C.c_char_p(PTX)) == 0
        f = C.c_void_p()
        r = self.cuModuleGetFunction(C.byref(f), mod, C.c_char_p(name))
        return r, f

    def launch(
        self,
        f: C.c_void_p,
        params: list,
        stream: int | None = None,
        grid: int = 1,
        block: int = 256,
    ) -> int:
        arr = (C.c_void_p * len(params))(*[C.cast(C.pointer(p), C.c_void_p) for p in params])
        # untyped ctypes arguments are C ints: a handle must go as a pointer
        return self.cuLaunchKernel(f, grid, 1, 1, block, 1, 1, 0, C.c_void_p(stream), arr, None)


def s_uninit(d: Drv) -> dict[str, int]:
    """Calls before cuInit, then without a current context."""
    out = {}
    dp = C.c_uint64()
    out["alloc_before_init"] = d.cuMemAlloc_v2(C.byref(dp), C.c_size_t(16))
    out["init_bad_flags"] = d.cuInit(1)
    out["init"] = d.cuInit(0)
    out["alloc_no_ctx"] = d.cuMemAlloc_v2(C.byref(dp), C.c_size_t(16))
    out["device_get_1"] = d.cuDeviceGet(C.byref(C.c_int()), 1)
    return out


def s_pointers(d: Drv) -> dict[str, int]:
    """Copies and frees with pointers that are not live device memory."""
    d.setup()
    buf = C.create_string_buffer(4096)
    r, p = d.alloc(4096)
    out = {"alloc": r, "alloc_zero": d.alloc(0)[0]}
    out["htod_ok"] = d.cuMemcpyHtoD_v2(C.c_uint64(p), buf, C.c_size_t(4096))
    out["htod_unallocated"] = d.cuMemcpyHtoD_v2(C.c_uint64(0xDEAD0000), buf, C.c_size_t(16))
    out["htod_null"] = d.cuMemcpyHtoD_v2(C.c_uint64(0), buf, C.c_size_t(16))
    out["htod_overrun"] = d.cuMemcpyHtoD_v2(C.c_uint64(p + 4088), buf, C.c_size_t(16))
    out["dtoh_interior_ok"] = d.cuMemcpyDtoH_v2(buf, C.c_uint64(p + 16), C.c_size_t(16))
    out["free_interior"] = d.cuMemFree_v2(C.c_uint64(p + 256))
    out["free"] = d.cuMemFree_v2(C.c_uint64(p))
    out["dtoh_after_free"] = d.cuMemcpyDtoH_v2(buf, C.c_uint64(p), C.c_size_t(16))
    out["double_free"] = d.cuMemFree_v2(C.c_uint64(p))
    out["memset_unallocated"] = d.cuMemsetD8_v2(C.c_uint64(0xDEAD0000), 0, C.c_size_t(4))
    return out


def s_pool(d: Drv) -> dict[str, int]:
    """Run with GF_DOUBLE_MEM_MIB=8: the pool really runs out, and recovers."""
    d.setup()
    mib = 1 << 20
    out = {}
    out["a"], a = d.alloc(4 * mib)
    out["b"], b = d.alloc(4 * mib)
    out["c"], _ = d.alloc(4 * mib)
    free, total = C.c_size_t(), C.c_size_t()
    d.cuMemGetInfo_v2(C.byref(free), C.byref(total))
    out["free_mib"], out["total_mib"] = free.value // mib, total.value // mib
    out["free_a"] = d.cuMemFree_v2(C.c_uint64(a))
    out["c_again"], _ = d.alloc(4 * mib)
    out["too_big"], _ = d.alloc(9 * mib)
    return out


def s_sticky(d: Drv) -> dict[str, int]:
    """A kernel writing outside its allocation poisons the context."""
    ctx = d.setup()
    out = {}
    r, p = d.alloc(4096)
    s = C.c_void_p()
    out["stream"] = d.cuStreamCreate(C.byref(s), CU_STREAM_NON_BLOCKING)
    out["getfunc"], f = d.function(b"gf_fill")
    # n = 4096 elements of 4 bytes: 16 KiB into a 4 KiB block
    out["launch"] = d.launch(f, [C.c_uint64(4096), C.c_uint32(7), C.c_uint64(p)], s.value, grid=16)
    out["sync"] = d.cuStreamSynchronize(s)
    out["alloc_after"], _ = d.alloc(16)
    out["ctx_sync_after"] = d.cuCtxSynchronize()
    out["destroy"] = d.cuCtxDestroy_v2(ctx)
    out["alloc_destroyed_ctx"], _ = d.alloc(16)
    ctx2 = C.c_void_p()
    out["new_ctx"] = d.cuCtxCreate_v2(C.byref(ctx2), 0, 0)
    out["alloc_new_ctx"], _ = d.alloc(16)
    return out


def s_kernels(d: Drv) -> dict[str, int]:
    """Built-in kernels compute on pool memory; module errors."""
    d.setup()
    out = {}
    n = 1000
    r, p = d.alloc(4 * n)
    out["getfunc_fill"], fill = d.function(b"gf_fill")
    out["getfunc_axpy"], axpy = d.function(b"gf_axpy")
    out["getfunc_missing"], _ = d.function(b"nope")
    out["getfunc_unsupported"], _ = d.function(b"gf_mystery")
    out["fill"] = d.launch(fill, [C.c_uint64(n), C.c_uint32(5), C.c_uint64(p)], grid=4)
    a = C.c_uint32(3)
    out["axpy"] = d.launch(axpy, [C.c_uint64(n), a, C.c_uint64(p), C.c_uint64(p)], grid=4)
    host = (C.c_uint32 * n)()
    out["dtoh"] = d.cuMemcpyDtoH_v2(host, C.c_uint64(p), C.c_size_t(4 * n))
    out["first"], out["last"] = host[0], host[n - 1]
    # a grid too small covers only gridDim * blockDim elements
    out["fill_partial"] = d.launch(fill, [C.c_uint64(n), C.c_uint32(1), C.c_uint64(p)], grid=1)
    d.cuMemcpyDtoH_v2(host, C.c_uint64(p), C.c_size_t(4 * n))
    out["partial_255"], out["partial_256"] = host[255], host[256]
    out["block_too_big"] = d.cuLaunchKernel(fill, 1, 1, 1, 2048, 1, 1, 0, None, None, None)
    out["no_params"] = d.cuLaunchKernel(fill, 1, 1, 1, 1, 1, 1, 0, None, None, None)
    out["bad_func"] = d.cuLaunchKernel(C.c_void_p(0), 1, 1, 1, 1, 1, 1, 0, None, None, None)
    mod = C.c_void_p()
    out["load_elf"] = d.cuModuleLoadData(C.byref(mod), C.c_char_p(b"\x7fELF\x02\x01\x01"))
    out["load_garbage"] = d.cuModuleLoadData(C.byref(mod), C.c_char_p(b"hello"))
    return out


def s_streams(d: Drv) -> dict[str, int]:
    """Events, waits and stream queries on worker-thread streams."""
    d.setup()
    out = {}
    s1, s2, e1, e2 = C.c_void_p(), C.c_void_p(), C.c_void_p(), C.c_void_p()
    out["s1"] = d.cuStreamCreate(C.byref(s1), 0)
    out["s2"] = d.cuStreamCreateWithPriority(C.byref(s2), CU_STREAM_NON_BLOCKING, -1)
    d.cuEventCreate(C.byref(e1), 0)
    d.cuEventCreate(C.byref(e2), 0)
    _, sleep = d.function(b"gf_fill")  # loaded for the module; gf_sleep comes next
    mod = C.c_void_p()
    ptx = PTX + b".visible .entry gf_sleep(.param .u64 us) { ret; }\n"
    d.cuModuleLoadData(C.byref(mod), C.c_char_p(ptx))
    fsleep = C.c_void_p()
    out["getfunc_sleep"] = d.cuModuleGetFunction(C.byref(fsleep), mod, b"gf_sleep")
    out["record_start"] = d.cuEventRecord(e1, s1)
    out["launch_sleep"] = d.launch(fsleep, [C.c_uint64(300000)], s1.value, grid=1, block=1)
    out["record_end"] = d.cuEventRecord(e2, s1)
    out["query_busy"] = d.cuStreamQuery(s1)
    out["event_query_busy"] = d.cuEventQuery(e2)
    out["wait_event"] = d.cuStreamWaitEvent(s2, e2, 0)
    out["sync_s2"] = d.cuStreamSynchronize(s2)  # returns only after s1's sleep
    out["event_query_done"] = d.cuEventQuery(e2)
    ms = C.c_float()
    out["elapsed"] = d.cuEventElapsedTime_v2(C.byref(ms), e1, e2)
    out["elapsed_ms"] = int(ms.value)
    out["query_idle"] = d.cuStreamQuery(s1)
    out["destroy"] = d.cuStreamDestroy_v2(s1)
    out["sync_destroyed"] = d.cuStreamSynchronize(s1)
    return out


def s_graph(d: Drv) -> dict[str, int]:
    """Stream capture -> instantiate -> launch -> update."""
    d.setup()
    out = {}
    n = 256
    _, p = d.alloc(4 * n)
    _, fill = d.function(b"gf_fill")
    s = C.c_void_p()
    d.cuStreamCreate(C.byref(s), CU_STREAM_NON_BLOCKING)
    out["begin"] = d.cuStreamBeginCapture_v2(s, 0)
    out["begin_again"] = d.cuStreamBeginCapture_v2(s, 0)
    out["captured_launch"] = d.launch(fill, [C.c_uint64(n), C.c_uint32(9), C.c_uint64(p)], s.value)
    out["sync_while_capturing"] = d.cuStreamSynchronize(s)
    g = C.c_void_p()
    out["end"] = d.cuStreamEndCapture(s, C.byref(g))
    host = (C.c_uint32 * n)()
    d.cuMemcpyDtoH_v2(host, C.c_uint64(p), C.c_size_t(4 * n))
    out["value_before_launch"] = host[0] if host[0] == 9 else 0
    x = C.c_void_p()
    out["instantiate"] = d.cuGraphInstantiateWithFlags(C.byref(x), g, C.c_ulonglong(0))
    out["launch"] = d.cuGraphLaunch(x, s)
    out["sync"] = d.cuStreamSynchronize(s)
    d.cuMemcpyDtoH_v2(host, C.c_uint64(p), C.c_size_t(4 * n))
    out["value_after_launch"] = host[n - 1]
    empty = C.c_void_p()
    d.cuGraphCreate(C.byref(empty), 0)

    class Info(C.Structure):
        _fields_ = [("result", C.c_int), ("errorNode", C.c_void_p), ("errorFromNode", C.c_void_p)]

    info = Info()
    out["update_topology"] = d.cuGraphExecUpdate_v2(x, empty, C.byref(info))
    out["update_result"] = info.result
    out["update_same"] = d.cuGraphExecUpdate_v2(x, g, C.byref(info))
    return out


def s_proc(d: Drv) -> dict[str, int]:
    """cuGetProcAddress resolves base names as cuda.h does; error names."""
    d.setup()
    out = {}
    pfn, status = C.c_void_p(), C.c_int(-1)
    out["mem_alloc"] = d.cuGetProcAddress_v2(b"cuMemAlloc", C.byref(pfn), 12000, 0, C.byref(status))
    v2 = C.cast(d.lib.cuMemAlloc_v2, C.c_void_p).value
    out["mem_alloc_is_v2"] = int(pfn.value == v2)
    out["status"] = status.value
    out["ptsz"] = d.cuGetProcAddress_v2(
        b"cuLaunchKernel",
        C.byref(pfn),
        12000,
        CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
        C.byref(status),
    )
    ptsz = C.cast(d.lib.cuLaunchKernel_ptsz, C.c_void_p).value
    out["ptsz_is_ptsz"] = int(pfn.value == ptsz)
    out["missing"] = d.cuGetProcAddress_v2(b"cuNoSuchCall", C.byref(pfn), 12000, 0, C.byref(status))
    out["missing_status"] = status.value
    return out


def s_errnames(d: Drv) -> dict[str, str | None]:
    """cuGetErrorName for every value 0..1000 (no init needed)."""
    out: dict[str, str | None] = {}
    s = C.c_char_p()
    for v in range(1001):
        r = d.cuGetErrorName(v, C.byref(s))
        out[str(v)] = s.value.decode() if r == 0 and s.value else None
    return out


SCENARIOS: dict[str, Callable[[Drv], dict]] = {
    "uninit": s_uninit,
    "pointers": s_pointers,
    "pool": s_pool,
    "sticky": s_sticky,
    "kernels": s_kernels,
    "streams": s_streams,
    "graph": s_graph,
    "proc": s_proc,
    "errnames": s_errnames,
}


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[2] not in SCENARIOS:
        print(f"usage: ctypes_probe.py LIBCUDA {{{','.join(SCENARIOS)}}}", file=sys.stderr)
        return 2
    out = SCENARIOS[sys.argv[2]](Drv(sys.argv[1]))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
