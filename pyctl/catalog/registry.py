"""Lookups over all catalogs: functions by symbol, their variants, return
codes by name or number, and argument decoding. The public API of
pyctl.catalog re-exports these."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

from .codes import code_name, code_value, codes, is_sticky
from .decode import _ptr, decode_with
from .libraries import LIBRARIES, lib_for_soname, lib_globs, library
from .model import FuncInfo, base_name


def decode_args(
    fn_name: str,
    raw_args: Sequence[int],
    read_str: Callable[[int], str | None] | None = None,
) -> dict[str, str]:
    """{arg name: text} for the register arguments present in raw_args
    (argument registers in order, as the BPF event carries them). A
    function the catalog does not know decodes as arg1..argN in hex.
    `read_str(addr)` may read a C string from the target for 'str' args."""
    info = lookup(fn_name)
    if info is None:
        return {f"arg{i + 1}": _ptr(v) for i, v in enumerate(raw_args)}
    return decode_with(info, raw_args, read_str)


__all__ = [
    "LIBRARIES",
    "code_name",
    "code_value",
    "codes",
    "current_symbol",
    "decode_args",
    "functions",
    "is_sticky",
    "lib_for_soname",
    "lib_globs",
    "lookup",
    "variants",
]

# What cuda.h's `#define cuX cuX_vN` lines make an application call today
# (CUDA 13.5 header), for the APIs in the catalog whose symbol is versioned.
HEADER_MAPS: dict[str, str] = {
    "cuDeviceTotalMem": "cuDeviceTotalMem_v2",
    "cuCtxCreate": "cuCtxCreate_v4",
    "cuCtxDestroy": "cuCtxDestroy_v2",
    "cuDevicePrimaryCtxRelease": "cuDevicePrimaryCtxRelease_v2",
    "cuDevicePrimaryCtxReset": "cuDevicePrimaryCtxReset_v2",
    "cuStreamDestroy": "cuStreamDestroy_v2",
    "cuStreamBeginCapture": "cuStreamBeginCapture_v2",
    "cuEventDestroy": "cuEventDestroy_v2",
    "cuEventElapsedTime": "cuEventElapsedTime_v2",
    "cuMemAlloc": "cuMemAlloc_v2",
    "cuMemAllocHost": "cuMemAllocHost_v2",
    "cuMemFree": "cuMemFree_v2",
    "cuMemGetInfo": "cuMemGetInfo_v2",
    "cuMemcpyHtoD": "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH": "cuMemcpyDtoH_v2",
    "cuMemcpyDtoD": "cuMemcpyDtoD_v2",
    "cuMemcpyHtoDAsync": "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync": "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync": "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8": "cuMemsetD8_v2",
    "cuMemsetD32": "cuMemsetD32_v2",
    "cuMemPrefetchAsync": "cuMemPrefetchAsync_v2",
    "cuMemAdvise": "cuMemAdvise_v2",
    "cuGraphInstantiate": "cuGraphInstantiateWithFlags",
    "cuGraphExecUpdate": "cuGraphExecUpdate_v2",
    "cuGetProcAddress": "cuGetProcAddress_v2",
    # cublas_v2.h
    "cublasCreate": "cublasCreate_v2",
    "cublasDestroy": "cublasDestroy_v2",
    "cublasSetStream": "cublasSetStream_v2",
    "cublasSetWorkspace": "cublasSetWorkspace_v2",
    "cublasSgemm": "cublasSgemm_v2",
}

_BY_NAME: dict[str, FuncInfo] = {}
_BY_ALIAS: dict[str, FuncInfo] = {}
for _lib in LIBRARIES.values():
    for _f in _lib.functions:
        if _f.name in _BY_NAME:
            raise RuntimeError(f"catalog: {_f.name} listed twice")
        _BY_NAME[_f.name] = _f
for _f in list(_BY_NAME.values()):
    for _a in _f.aliases:
        if _a in _BY_NAME or _a in _BY_ALIAS:
            raise RuntimeError(f"catalog: alias {_a} of {_f.name} clashes")
        _BY_ALIAS[_a] = _f

_PT = re.compile(r"_pt(sz|ds)$")


def _version(name: str) -> int:
    m = re.search(r"_v(\d+)(?:_64)?$", name)
    return int(m.group(1)) if m else 1


@functools.lru_cache(maxsize=4096)
def lookup(fn_name: str) -> FuncInfo | None:
    """The FuncInfo for an exported symbol (cached: every fire asks, and
    an unknown name costs a scan of the whole catalog). Exact names and aliases first
    (`cuLaunchKernel_ptsz`, `pncclAllReduce`), then the per-thread suffix
    dropped, then the base API name resolved as cuda.h resolves it today
    (`cuMemAlloc` -> cuMemAlloc_v2, `cuGraphInstantiate` ->
    cuGraphInstantiateWithFlags). None when the catalog does not know it."""
    for cand in (fn_name, _PT.sub("", fn_name)):
        hit = _BY_NAME.get(cand) or _BY_ALIAS.get(cand)
        if hit is not None:
            return hit
    base = base_name(fn_name)
    if base in HEADER_MAPS:
        return _BY_NAME[HEADER_MAPS[base]]
    same = [f for f in _BY_NAME.values() if f.base == base]
    if not same:
        return None
    # An unknown version of a known API: the newest catalogued one decodes
    # at least the leading arguments right.
    return max(same, key=lambda f: _version(f.name))


def current_symbol(api: str) -> str | None:
    """The symbol today's headers make `api` call: 'cuMemAlloc' -> 'cuMemAlloc_v2'."""
    if api in HEADER_MAPS:
        return HEADER_MAPS[api]
    info = lookup(api)
    return info.name if info is not None else None


def functions(lib: str | None = None, *, hot: bool | None = None) -> list[FuncInfo]:
    """All catalogued functions, optionally of one library (any --lib
    spelling) and/or only the hot (or only the cold) ones."""
    if lib is None:
        out = list(_BY_NAME.values())
    else:
        out = list(library(lib).functions)
    if hot is not None:
        out = [f for f in out if f.hot == hot]
    return out


def variants(base: str) -> list[str]:
    """Every exported symbol that implements API `base`, sorted:
    variants('cuCtxCreate') -> ['cuCtxCreate', 'cuCtxCreate_v2',
    'cuCtxCreate_v3', 'cuCtxCreate_v4']. Empty when unknown."""
    b = base_name(base)
    names: set[str] = set()
    infos = [f for f in _BY_NAME.values() if f.base == b]
    if b in HEADER_MAPS:
        infos.append(_BY_NAME[HEADER_MAPS[b]])
    for f in infos:
        names.add(f.name)
        names.update(f.aliases)
    # p-prefixed NCCL names and legacy aliases belong to their entry's API.
    return sorted(names)
