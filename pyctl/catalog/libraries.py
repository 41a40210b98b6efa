"""The library table: which module describes which library, and how a
library is recognized by its soname or by the name a user types."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from types import ModuleType

from . import cublas, cuda, cufft, nccl
from .model import FuncInfo


@dataclass(frozen=True)
class Library:
    name: str  # what `--lib` takes and FuncInfo.lib holds
    soname_globs: tuple[str, ...]
    codes: dict[int, str]
    aliases: dict[str, str]
    prefixes: tuple[str, ...]  # code-name prefixes a user may leave out
    enums: dict[str, dict[int, str]]
    functions: tuple[FuncInfo, ...]
    sticky: frozenset[int] = frozenset()


def _lib(
    mod: ModuleType, name: str, globs: tuple[str, ...], funcs: tuple[FuncInfo, ...]
) -> Library:
    return Library(
        name=name,
        soname_globs=globs,
        codes=mod.CODES,
        aliases=mod.ALIASES,
        prefixes=mod.CODE_PREFIXES,
        enums=mod.ENUMS,
        functions=funcs,
        sticky=getattr(mod, "STICKY", frozenset()),
    )


LIBRARIES: dict[str, Library] = {
    "cuda": _lib(cuda, "cuda", cuda.SONAME_GLOBS, cuda.FUNCTIONS),
    "nccl": _lib(nccl, "nccl", nccl.SONAME_GLOBS, nccl.FUNCTIONS),
    "cublas": _lib(
        cublas,
        "cublas",
        cublas.SONAME_GLOBS,
        tuple(f for f in cublas.FUNCTIONS if f.lib == cublas.LIB),
    ),
    "cublasLt": _lib(
        cublas,
        "cublasLt",
        cublas.SONAME_GLOBS_LT,
        tuple(f for f in cublas.FUNCTIONS if f.lib == cublas.LIB_LT),
    ),
    "cufft": _lib(cufft, "cufft", cufft.SONAME_GLOBS, cufft.FUNCTIONS),
    # The CUDA runtime is recognized (it shows up in maps next to libcuda) but
    # has no catalog: it reaches the driver through cuGetProcAddress, so the
    # driver symbols are where faults go.
    "cudart": Library(
        name="cudart",
        soname_globs=("libcudart.so", "libcudart.so.*"),
        codes={},
        aliases={},
        prefixes=(),
        enums={},
        functions=(),
    ),
}

# Other spellings accepted by --lib (compared lower-case, '-' and '_' dropped).
_LIB_ALIASES = {
    "cuda": "cuda",
    "libcuda": "cuda",
    "driver": "cuda",
    "nccl": "nccl",
    "libnccl": "nccl",
    "cublas": "cublas",
    "libcublas": "cublas",
    "cublaslt": "cublasLt",
    "libcublaslt": "cublasLt",
    "lt": "cublasLt",
    "cufft": "cufft",
    "libcufft": "cufft",
    "cudart": "cudart",
    "libcudart": "cudart",
    "runtime": "cudart",
}


def _norm(s: str) -> str:
    return s.lower().replace("-", "").replace("_", "")


def library(name: str) -> Library:
    """The Library for a name a user typed (`cuda`, `cublas-lt`, ...)."""
    key = _LIB_ALIASES.get(_norm(name))
    if key is None:
        known = ", ".join(LIBRARIES)
        raise ValueError(f"unknown library {name!r}; use one of: {known}")
    return LIBRARIES[key]


def lib_globs(name: str) -> tuple[str, ...]:
    """Soname globs for `--lib NAME`: lib_globs('cuda') -> ('libcuda.so', 'libcuda.so.*')."""
    return library(name).soname_globs


def lib_for_soname(soname_or_path: str) -> str | None:
    """'libcuda.so.1' (or a path to it, as in /proc/PID/maps) -> 'cuda'."""
    base = os.path.basename(soname_or_path.rstrip())
    # maps may show " (deleted)" after a replaced file
    base = base.removesuffix(" (deleted)")
    for lib in LIBRARIES.values():
        if any(fnmatch.fnmatchcase(base, g) for g in lib.soname_globs):
            return lib.name
    return None
