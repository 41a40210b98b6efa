"""Catalogs of GPU library functions: argument names and kinds, return codes,
and the libraries' sonames. The probe engine uses them to decode arguments,
to name return codes and to accept error names the user types.

    >>> from pyctl import catalog
    >>> catalog.lookup("cuMemAlloc_v2").args[1].name
    'bytesize'
    >>> catalog.code_value("cuda", "oom")
    2
"""

from __future__ import annotations

from .model import ARG_REGS, Arg, FuncInfo, base_name
from .registry import (
    LIBRARIES,
    code_name,
    code_value,
    codes,
    current_symbol,
    decode_args,
    functions,
    is_sticky,
    lib_for_soname,
    lib_globs,
    lookup,
    variants,
)

__all__ = [
    "ARG_REGS",
    "Arg",
    "FuncInfo",
    "LIBRARIES",
    "base_name",
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
