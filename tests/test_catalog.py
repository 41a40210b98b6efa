"""The function catalogs: lookups, variants, return codes, argument decoding,
sonames, and agreement with the vendor headers (cuda.h when one is found,
and always with doubles/gf_cuda.h, the double's copy)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from pyctl import catalog
from pyctl.catalog import cublas, cuda, cufft, nccl
from pyctl.catalog.model import KINDS

REPO = Path(__file__).resolve().parent.parent


def _info(name: str) -> catalog.FuncInfo:
    info = catalog.lookup(name)
    assert info is not None, name
    return info


REQUIRED_CUDA = """cuInit cuDeviceGet cuCtxCreate_v2 cuCtxCreate_v3 cuCtxCreate_v4
cuCtxSynchronize cuStreamCreate cuStreamCreateWithPriority cuStreamSynchronize
cuStreamWaitEvent cuEventRecord cuEventSynchronize cuMemAlloc_v2 cuMemAllocAsync
cuMemAllocManaged cuMemFree_v2 cuMemFreeAsync cuMemcpyHtoD_v2 cuMemcpyDtoH_v2
cuMemcpyHtoDAsync_v2 cuMemcpyDtoHAsync_v2 cuLaunchKernel cuLaunchKernelEx
cuGraphInstantiateWithFlags cuGraphInstantiateWithParams cuGraphLaunch
cuGraphExecUpdate cuGraphExecUpdate_v2 cuMemPrefetchAsync cuMemPrefetchAsync_v2
cuMemAdvise cuGetProcAddress cuGetProcAddress_v2 cuModuleLoadData
cuModuleGetFunction""".split()

REQUIRED_NCCL = """ncclCommInitRank ncclCommInitRankConfig ncclCommInitAll ncclAllReduce
ncclBroadcast ncclAllGather ncclReduceScatter ncclReduce ncclSend ncclRecv
ncclGroupStart ncclGroupEnd ncclCommAbort ncclCommDestroy""".split()

REQUIRED_CUBLAS = """cublasCreate_v2 cublasDestroy_v2 cublasSetStream_v2 cublasSgemm_v2
cublasHgemm cublasGemmEx cublasGemmStridedBatchedEx cublasLtCreate
cublasLtMatmul""".split()

REQUIRED_CUFFT = """cufftPlan1d cufftPlan2d cufftPlan3d cufftPlanMany cufftMakePlan1d
cufftMakePlan2d cufftMakePlan3d cufftMakePlanMany cufftExecC2C cufftExecR2C
cufftExecC2R cufftExecZ2Z cufftDestroy""".split()


@pytest.mark.parametrize(
    "lib,names",
    [
        ("cuda", REQUIRED_CUDA),
        ("nccl", REQUIRED_NCCL),
        ("cublas", [n for n in REQUIRED_CUBLAS if not n.startswith("cublasLt")]),
        ("cublasLt", [n for n in REQUIRED_CUBLAS if n.startswith("cublasLt")]),
        ("cufft", REQUIRED_CUFFT),
    ],
)
def test_required_functions_are_catalogued(lib: str, names: list[str]) -> None:
    for name in names:
        info = catalog.lookup(name)
        assert info is not None, name
        assert info.lib == lib, name


def test_every_entry_is_well_formed() -> None:
    seen: set[str] = set()
    for f in catalog.functions():
        assert f.name not in seen
        seen.add(f.name)
        assert f.ret_kind.startswith("enum:"), f.name
        for a in f.args:
            kind = a.kind.split(":", 1)[0] + (":" if ":" in a.kind else "")
            assert kind in KINDS or kind == "enum:", (f.name, a)
            if a.kind.startswith("enum:"):
                lib = catalog.LIBRARIES[f.lib]
                assert a.kind[5:] in lib.enums, (f.name, a)
        names = [a.name for a in f.args]
        assert len(names) == len(set(names)), f.name


def test_lookup_resolves_variants() -> None:
    assert catalog.lookup("cuLaunchKernel_ptsz") is catalog.lookup("cuLaunchKernel")
    assert _info("cuMemcpyHtoD_v2_ptds").name == "cuMemcpyHtoD_v2"
    assert _info("cuMemcpyHtoDAsync_v2_ptsz").name == "cuMemcpyHtoDAsync_v2"
    # a base API name resolves the way today's cuda.h resolves it
    assert _info("cuMemAlloc").name == "cuMemAlloc_v2"
    assert _info("cuMemcpyDtoH").name == "cuMemcpyDtoH_v2"
    assert _info("cuStreamDestroy").name == "cuStreamDestroy_v2"
    # exact symbols win: each cuCtxCreate version has its own signature
    assert len(_info("cuCtxCreate_v3").args) == 5
    assert len(_info("cuCtxCreate_v4").args) == 4
    assert _info("pncclAllReduce").name == "ncclAllReduce"
    assert _info("cublasSgemm_v2_64").args[3].ctype == "int64_t"
    assert catalog.lookup("cuNoSuchThing") is None
    assert catalog.lookup("cuNoSuchThing_v2") is None


def test_variants() -> None:
    assert catalog.variants("cuCtxCreate") == [
        "cuCtxCreate",
        "cuCtxCreate_v2",
        "cuCtxCreate_v3",
        "cuCtxCreate_v4",
    ]
    assert catalog.variants("cuLaunchKernel") == ["cuLaunchKernel", "cuLaunchKernel_ptsz"]
    assert "cuGraphInstantiateWithFlags" in catalog.variants("cuGraphInstantiate")
    assert catalog.variants("cuMemAlloc") == ["cuMemAlloc", "cuMemAlloc_v2"]
    assert catalog.variants("ncclSend") == ["ncclSend", "pncclSend"]
    assert catalog.variants("nothing") == []
    assert catalog.current_symbol("cuGraphExecUpdate") == "cuGraphExecUpdate_v2"


def test_hot_functions_are_marked() -> None:
    hot = {f.name for f in catalog.functions(hot=True)}
    for name in ("cuLaunchKernel", "cuLaunchKernelEx", "cuEventRecord", "cuStreamWaitEvent"):
        assert name in hot
    assert "cuMemAlloc_v2" not in hot
    assert all(f.lib == "cuda" for f in catalog.functions("cuda", hot=True))


@pytest.mark.parametrize(
    "lib,text,value",
    [
        ("cuda", "CUDA_ERROR_OUT_OF_MEMORY", 2),
        ("cuda", "OUT_OF_MEMORY", 2),
        ("cuda", "out-of-memory", 2),
        ("cuda", "oom", 2),
        ("cuda", "2", 2),
        ("cuda", "0x2", 2),
        ("cuda", "-1", -1),
        ("cuda", "CUDA_SUCCESS", 0),
        ("cuda", "illegal", 700),
        ("cuda", "CONTEXT_IS_DESTROYED", 709),
        ("cuda", "launch_failed", 719),
        ("cuda", "GRAPH_EXEC_UPDATE_FAILURE", 910),
        ("cuda", "unknown", 999),
        ("nccl", "ncclSystemError", 2),
        ("nccl", "SystemError", 2),
        ("nccl", "remote", 6),
        ("nccl", "ncclInProgress", 7),
        ("cublas", "CUBLAS_STATUS_ALLOC_FAILED", 3),
        ("cublas", "EXECUTION_FAILED", 13),
        ("cublasLt", "internal", 14),
        ("cufft", "CUFFT_INVALID_VALUE", 4),
        ("cufft", "exec", 6),
    ],
)
def test_code_value(lib: str, text: str, value: int) -> None:
    assert catalog.code_value(lib, text) == value


def test_code_value_errors_are_one_line_with_suggestions() -> None:
    with pytest.raises(ValueError) as e:
        catalog.code_value("cuda", "OUT_OF_MEMROY")
    msg = str(e.value)
    assert "\n" not in msg
    assert "CUDA_ERROR_OUT_OF_MEMORY" in msg
    with pytest.raises(ValueError, match="unknown library"):
        catalog.code_value("opencl", "oom")
    with pytest.raises(ValueError, match="32 bits"):
        catalog.code_value("cuda", str(1 << 40))


def test_aliases_name_real_codes_and_do_not_collide() -> None:
    for mod in (cuda, nccl, cublas, cufft):
        names = set(mod.CODES.values())
        for alias, name in mod.ALIASES.items():
            assert name in names, (mod.LIB, alias)
        # every code name round-trips through its short (prefix-less) form
        for value, name in mod.CODES.items():
            short = name
            for p in mod.CODE_PREFIXES:
                if name.startswith(p):
                    short = name[len(p) :]
                    break
            assert catalog.code_value(mod.LIB, short) == value, name


def test_code_name() -> None:
    assert catalog.code_name("cuda", 2) == "CUDA_ERROR_OUT_OF_MEMORY"
    assert catalog.code_name("cuda", 0xFFFFFFFF00000002) == "CUDA_ERROR_OUT_OF_MEMORY"
    assert catalog.code_name("cuda", 12345) is None
    assert catalog.code_name("nccl", 6) == "ncclRemoteError"
    assert catalog.code_name("cufft", 0x10) == "CUFFT_NOT_SUPPORTED"
    assert catalog.is_sticky("cuda", 700) and not catalog.is_sticky("cuda", 2)


def test_cuda_codes_complete_enough() -> None:
    want = {0, 1, 2, 3, 4, 46, 100, 101, 200, 201, 214, 400, 500, 600, 700, 701, 702}
    want |= {709, 719, 900, 910, 999}
    assert want <= set(cuda.CODES)
    assert len(cuda.CODES) > 100
    assert set(nccl.CODES) == set(range(9))
    assert set(cublas.CODES) == {0, 1, 3, 7, 8, 11, 13, 14, 15, 16}


def test_decode_args() -> None:
    d = catalog.decode_args("cuMemAlloc_v2", [0x7FFD12340000, 256 << 20])
    assert d == {"dptr": "0x7ffd12340000", "bytesize": "268435456 (256 MiB)"}
    d = catalog.decode_args("cuLaunchKernel", [0x55AA, 1024, 1, 1, 256, 1])
    assert d["f"] == "0x55aa" and d["gridDimX"] == "1024" and d["blockDimY"] == "1"
    assert "hStream" not in d  # the 9th argument is on the stack
    d = catalog.decode_args("cuStreamSynchronize_ptsz", [0])
    assert d == {"hStream": "NULL"}
    d = catalog.decode_args("ncclAllReduce", [0x1000, 0x2000, 4096, 7, 0, 0xABC])
    assert d["datatype"] == "ncclFloat32" and d["op"] == "ncclSum" and d["count"] == "4096"
    # ncclUniqueId (128 bytes) travels on the stack: rank is the 3rd register
    d = catalog.decode_args("ncclCommInitRank", [0x1000, 8, 3])
    assert d == {"comm": "0x1000", "nranks": "8", "rank": "3"}
    d = catalog.decode_args("cuMemAdvise", [0x7F0000000000, 4096, 3, 0])
    assert d["advice"] == "CU_MEM_ADVISE_SET_PREFERRED_LOCATION"
    d = catalog.decode_args("cuMemPrefetchAsync_v2", [0x7F0000000000, 1 << 20, (5 << 32) | 1])
    assert d["location"] == "CU_MEM_LOCATION_TYPE_DEVICE id=5"
    d = catalog.decode_args("cublasGemmEx", [0x1, 1, 0, 64, 2**32 - 1, 8])
    assert d["transa"] == "CUBLAS_OP_T" and d["n"] == "-1"
    d = catalog.decode_args("cufftPlan1d", [0x10, 1024, 0x29, 8])
    assert d["type"] == "CUFFT_C2C"
    d = catalog.decode_args(
        "cuModuleGetFunction", [0x1, 0x2, 0x3], read_str=lambda a: "gf_axpy" if a == 3 else None
    )
    assert d["name"] == "'gf_axpy'"
    assert catalog.decode_args("mystery", [1, 255]) == {"arg1": "0x1", "arg2": "0xff"}


def test_arg_index_for_predicates() -> None:
    assert _info("cuMemAlloc_v2").arg_index("bytesize") == 2
    assert _info("ncclCommInitRank").arg_index("rank") == 3
    assert _info("cuLaunchKernel").arg_index("hStream") is None


@pytest.mark.parametrize(
    "soname,lib",
    [
        ("libcuda.so.1", "cuda"),
        ("/usr/local/nvidia/lib64/libcuda.so.580.159.04", "cuda"),
        ("/work/main/build/doubles/libcuda.so.1", "cuda"),
        ("libcudart.so.12", "cudart"),
        ("libnccl.so.2", "nccl"),
        ("/x/nvidia/cublas/lib/libcublas.so.12", "cublas"),
        ("libcublasLt.so.13", "cublasLt"),
        ("libcufft.so.11", "cufft"),
        ("libc.so.6", None),
        ("libcufftw.so.11", None),
    ],
)
def test_lib_for_soname(soname: str, lib: str | None) -> None:
    assert catalog.lib_for_soname(soname) == lib


def test_lib_globs() -> None:
    assert catalog.lib_globs("cuda") == ("libcuda.so", "libcuda.so.*")
    assert catalog.lib_globs("nccl") == ("libnccl.so", "libnccl.so.*")
    assert catalog.lib_globs("cublas-lt") == ("libcublasLt.so", "libcublasLt.so.*")
    assert catalog.lib_globs("CUFFT") == ("libcufft.so", "libcufft.so.*")
    with pytest.raises(ValueError, match="use one of"):
        catalog.lib_globs("rocm")


# --- agreement with C headers -------------------------------------------------


def _norm_type(t: str) -> str:
    return re.sub(r"\s*\*", "*", " ".join(t.split()))


def _parse_params(text: str) -> list[tuple[str, str]]:
    text = " ".join(text.split())
    if text in ("", "void"):
        return []
    out = []
    for p in text.split(","):
        m = re.match(r"(.*?)([A-Za-z_]\w*)$", p.strip())
        assert m, p
        out.append((_norm_type(m.group(1)), m.group(2)))
    return out


def _declarations(text: str) -> tuple[dict[str, set[str]], dict[str, list[list[tuple[str, str]]]]]:
    """(#define name -> targets, declared name -> parameter lists) of a header."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    maps: dict[str, set[str]] = {}
    pat = r"#define\s+(cu\w+)\s+(?:__CUDA_API_PT(?:DS|SZ)\((\w+)\)|(cu\w+))\s*$"
    for m in re.finditer(pat, text, re.M):
        maps.setdefault(m.group(1), set()).add(m.group(2) or m.group(3))
    decls: dict[str, list[list[tuple[str, str]]]] = {}
    for m in re.finditer(r"CUresult\s+(?:CUDAAPI\s+)?(cu\w+)\s*\(([^;{]*?)\)\s*;", text, re.S):
        decls.setdefault(m.group(1), []).append(_parse_params(m.group(2)))
    return maps, decls


def _catalog_params(f: catalog.FuncInfo) -> list[tuple[str, str]]:
    return [(_norm_type(a.ctype), a.name) for a in f.args]


def _mismatches(header: str) -> list[str]:
    maps, decls = _declarations(header)
    bad = []
    for f in catalog.functions("cuda"):
        names = [f.name, *f.aliases]
        cands = [d for d, targets in maps.items() if targets & set(names)] + names
        sigs = [s for c in cands for s in decls.get(c, [])]
        if _catalog_params(f) not in sigs:
            bad.append(f.name)
    return bad


def _find_cuda_h() -> Path | None:
    dirs = [os.environ.get("GF_CUDA_INCLUDE", ""), os.environ.get("CUDA_HOME", "") + "/include"]
    dirs.append("/usr/local/cuda/include")
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            dirs += [str(p.parent) for p in Path(root).glob("*/include/cuda.h")]
    for d in dirs:
        if d and (Path(d) / "cuda.h").is_file():
            return Path(d) / "cuda.h"
    return None


def test_catalog_matches_real_cuda_h() -> None:
    path = _find_cuda_h()
    if path is None:
        pytest.skip(
            "no cuda.h found (set GF_CUDA_INCLUDE, or pip install nvidia-cuda-runtime-cu12)"
        )
    assert _mismatches(path.read_text(errors="replace")) == []


def test_catalog_matches_the_doubles_header() -> None:
    # gf_cuda.h is the double's transcription of cuda.h: it must agree with
    # the catalog for every function it declares, and declare most of them.
    header = (REPO / "doubles" / "gf_cuda.h").read_text()
    _, decls = _declarations(header)
    checked = 0
    for f in catalog.functions("cuda"):
        if f.name in decls:
            assert _catalog_params(f) in decls[f.name], f.name
            checked += 1
    assert checked >= 60
