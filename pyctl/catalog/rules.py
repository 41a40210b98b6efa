"""What an error return is, per function: the catalog's rule (a catalogued
function returning a result enum whose 0 is success errs on any other
value, a 32-bit code named from its library's table); any other
function's return value is not classified (an int -1, a pointer and a
count look alike in a register).

Here, beside the code tables it reads, so that the trace summaries
(pyctl/calls/) and the evidence's words (pyctl/evidence/words.py) ask one
rule from below instead of the evidence importing the calls floor above it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyctl.bpf.aggregate_abi import ERR_NONE, ERR_NONZERO32

from .codes import code_name
from .libraries import lib_for_soname, library
from .registry import lookup

RULE_NAMES = {ERR_NONE: "none", ERR_NONZERO32: "nonzero32"}


@dataclass(frozen=True)
class ErrorRule:
    """How one function's return value reads: `mode` is an
    aggregate_abi.ERR_* rule, `lib` the catalog library that names codes."""

    mode: int = ERR_NONE
    lib: str | None = None

    @property
    def name(self) -> str:
        return RULE_NAMES[self.mode]

    def is_error(self, ret: int) -> bool:
        return self.mode == ERR_NONZERO32 and s32(ret) != 0

    def code_name(self, ret: int) -> str:
        """'CUDA_ERROR_OUT_OF_MEMORY', or the number for a code the table lacks."""
        v = s32(ret)
        if self.lib is not None:
            name = code_name(self.lib, v)
            if name:
                return name
        return str(v)


def s32(v: int) -> int:
    """A register's low 32 bits as the signed result code C returns."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def error_rule(symbol: str, library_name: str = "") -> ErrorRule:
    """The rule for `symbol` in `library_name` (a path or soname). A symbol
    the catalog knows found in a library of another catalog (by soname) is
    not trusted."""
    info = lookup(symbol)
    if info is None or not info.ret_kind.startswith("enum:"):
        return ErrorRule()
    owner = lib_for_soname(library_name) if library_name else None
    if owner is not None and owner != info.lib:
        return ErrorRule()
    codes = library(info.lib).codes
    if not codes or "SUCCESS" not in codes.get(0, "").upper():
        return ErrorRule()
    return ErrorRule(ERR_NONZERO32, info.lib)
