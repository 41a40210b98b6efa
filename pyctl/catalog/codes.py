"""Return codes by name or number: what `--error` accepts and what evidence
shows. Names are matched without case, '-' or '_', with or without the
library's prefix (CUDA_ERROR_, nccl, CUBLAS_STATUS_, CUFFT_), and by the
short aliases each library module lists (oom, illegal, ...)."""

from __future__ import annotations

import difflib

from .libraries import Library, library

_INT32_MIN = -(2**31)
_UINT32_MAX = 2**32 - 1


def _norm(s: str) -> str:
    return s.strip().lower().replace("-", "").replace("_", "").replace(" ", "")


def _index(lib: Library) -> dict[str, int]:
    """Every accepted spelling (normalized) -> value."""
    by_name = {name: value for value, name in lib.codes.items()}
    idx: dict[str, int] = {}
    for name, value in by_name.items():
        idx[_norm(name)] = value
        for p in lib.prefixes:
            if name.lower().startswith(p.lower()) and len(name) > len(p):
                idx.setdefault(_norm(name[len(p) :]), value)
    for alias, name in lib.aliases.items():
        idx.setdefault(_norm(alias), by_name[name])
    return idx


_INDEXES: dict[str, dict[str, int]] = {}


def _idx(lib: Library) -> dict[str, int]:
    if lib.name not in _INDEXES:
        _INDEXES[lib.name] = _index(lib)
    return _INDEXES[lib.name]


def _parse_int(text: str) -> int | None:
    t = text.strip()
    try:
        return int(t, 0)
    except ValueError:
        pass
    try:
        return int(t, 10)  # "010": int(x, 0) refuses leading zeros
    except ValueError:
        return None


def code_value(lib: str, name_or_int: str | int) -> int:
    """'CUDA_ERROR_OUT_OF_MEMORY', 'OUT_OF_MEMORY', 'oom', '2', '0x2' -> 2.
    Raises ValueError with a one-line message naming close matches."""
    info = library(lib)
    if isinstance(name_or_int, int):
        value: int | None = name_or_int
    else:
        value = _parse_int(name_or_int)
    if value is not None:
        if not _INT32_MIN <= value <= _UINT32_MAX:
            raise ValueError(f"{lib} code {value} does not fit in 32 bits")
        return value
    if not info.codes:
        raise ValueError(f"no return-code table for {info.name}; give the code as a number")
    text = str(name_or_int)
    idx = _idx(info)
    key = _norm(text)
    if key in idx:
        return idx[key]
    close = difflib.get_close_matches(key, list(idx), n=3, cutoff=0.6)
    names = sorted({info.codes[idx[c]] for c in close})
    hint = f"; did you mean {', '.join(names)}?" if names else ""
    examples = ", ".join(a for a in info.aliases if a not in ("ok", "success"))
    raise ValueError(
        f"unknown {info.name} code {text!r}{hint} (give a name, a number, "
        f"or a short alias: {examples})"
    )


def _as_int32(value: int) -> int:
    # Return registers are 64 bits; the C enums are 32-bit ints.
    v = value & 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def code_name(lib: str, value: int) -> str | None:
    """2 -> 'CUDA_ERROR_OUT_OF_MEMORY'; None for values the table lacks."""
    return library(lib).codes.get(_as_int32(value))


def codes(lib: str) -> dict[int, str]:
    """The whole table, value -> name (a copy)."""
    return dict(library(lib).codes)


def is_sticky(lib: str, value: int) -> bool:
    """True for codes after which the real library's context is unusable
    (CUDA: ILLEGAL_ADDRESS, LAUNCH_FAILED, ...)."""
    return _as_int32(value) in library(lib).sticky
