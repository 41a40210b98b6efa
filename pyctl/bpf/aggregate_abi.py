"""Python mirrors of bpf/aggregate.h (the in-kernel summary programs).
tests/test_aggregate_abi.py compiles a C program against the header and
checks every size and field offset here."""

from __future__ import annotations

import ctypes as C

SLOTS = 40  # AGG_SLOTS: log2 ns buckets, the last one open-ended
DEPTH = 16  # AGG_DEPTH
MISC_MAX = 4

ERR_NONE, ERR_NONZERO32 = 0, 1
MISC_NAMES = ("no_task_storage", "nested_too_deep", "unmatched_return", "map_full")


def cookie(rule: int, func: int) -> int:
    """AGG_COOKIE: the error rule in the high half, the function index low."""
    return (rule << 32) | (func & 0xFFFFFFFF)


class AggKey(C.Structure):
    _fields_ = [("func", C.c_uint32), ("tid", C.c_uint32)]


class AggStats(C.Structure):
    _fields_ = [
        ("calls", C.c_uint64),
        ("returns", C.c_uint64),
        ("errors", C.c_uint64),
        ("lat_sum", C.c_uint64),
        ("lat_max", C.c_uint64),
        ("hist", C.c_uint64 * SLOTS),
    ]


class AggErrKey(C.Structure):
    _fields_ = [("func", C.c_uint32), ("tid", C.c_uint32), ("ret", C.c_int64)]


# name in the C header -> mirror, for the ABI test.
MIRRORS: dict[str, type[C.Structure]] = {
    "agg_key": AggKey,
    "agg_stats": AggStats,
    "agg_err_key": AggErrKey,
}
