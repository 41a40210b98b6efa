"""Argument decoding: raw register values of a call -> readable strings,
following each argument's kind (hex for pointers, decimal with MiB for
sizes, enum names)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .libraries import library
from .model import Arg, FuncInfo

_MIB = 1 << 20
_STREAMS = {0: "NULL", 1: "CU_STREAM_LEGACY", 2: "CU_STREAM_PER_THREAD"}


def _s32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def _s64(v: int) -> int:
    v &= 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v & (1 << 63) else v


def fmt_size(v: int) -> str:
    """268435456 -> '268435456 (256 MiB)'."""
    v &= 0xFFFFFFFFFFFFFFFF
    return f"{v} ({v / _MIB:.6g} MiB)"


def _ptr(v: int) -> str:
    v &= 0xFFFFFFFFFFFFFFFF
    return "NULL" if v == 0 else f"{v:#x}"


def _enum(table: dict[int, str] | None, v: int) -> str:
    iv = _s32(v)
    if table and iv in table:
        return table[iv]
    return str(iv)


def decode_arg(
    arg: Arg,
    raw: int,
    enums: dict[str, dict[int, str]],
    read_str: Callable[[int], str | None] | None = None,
) -> str:
    k = arg.kind
    if k == "int" or k == "device" or k == "handle32":
        return str(_s32(raw))
    if k == "uint":
        return str(raw & 0xFFFFFFFF)
    if k == "i64":
        return str(_s64(raw))
    if k == "u64" or k == "count":
        return str(raw & 0xFFFFFFFFFFFFFFFF)
    if k == "flags":
        wide = "long" in arg.ctype or "64" in arg.ctype
        return f"{raw & (0xFFFFFFFFFFFFFFFF if wide else 0xFFFFFFFF):#x}"
    if k == "size":
        return fmt_size(raw)
    if k == "handle" and "Stream" in arg.ctype or k == "handle" and arg.ctype == "CUstream":
        v = raw & 0xFFFFFFFFFFFFFFFF
        return _STREAMS.get(v, f"{v:#x}")
    if k in ("ptr", "out_ptr", "handle"):
        return _ptr(raw)
    if k == "str":
        if read_str is not None and raw:
            text = read_str(raw)
            if text is not None:
                return repr(text)
        return _ptr(raw)
    if k == "memloc":
        # CUmemLocation {CUmemLocationType type; int id;} packed little-endian
        loc_type = _enum(enums.get("CUmemLocationType"), raw & 0xFFFFFFFF)
        return f"{loc_type} id={_s32(raw >> 32)}"
    if k.startswith("enum:"):
        return _enum(enums.get(k[5:]), raw)
    return f"{raw & 0xFFFFFFFFFFFFFFFF:#x}"


def decode_with(
    info: FuncInfo,
    raw_args: Sequence[int],
    read_str: Callable[[int], str | None] | None = None,
) -> dict[str, str]:
    enums = library(info.lib).enums
    out: dict[str, str] = {}
    for arg, reg in info.registers():
        if reg < len(raw_args):
            out[arg.name] = decode_arg(arg, raw_args[reg], enums, read_str)
    return out
