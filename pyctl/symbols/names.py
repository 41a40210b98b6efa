"""Which of a function's names gpufault uses: one rule for every reader.

A function often has several names at one address: the double's (and
older libcuda's) `cuMemAlloc` beside `cuMemAlloc_v2`, glibc's `malloc`
beside `__libc_malloc` and `__GI___libc_malloc`. Where the probe site is
resolved (pyctl/symbols/resolve.py: trace, `calls live`, inject, so the
funcs and faults rows, the summaries and the metrics) and where a stack
frame is named (pyctl/symbols/symtab.py: `show`'s frames), the same name
wins, by canonical(); the others are the site's aliases.

The order: a public name over glibc's `__GI_` alias and over a versioned
duplicate (`glob64@GLIBC_2.2.5`); then fewer leading underscores (`malloc`
over `__libc_malloc`, the weak `getpid` over the global `__getpid` it
aliases: the name a program calls and `--fn` is given); then a global over
a weak over a local symbol; then a plain name over its CUDA per-thread-
stream twin (`cuMemAllocAsync` over `cuMemAllocAsync_ptsz`, as the catalog
names them); then the longer (`cuMemAlloc_v2` over `cuMemAlloc`: the
versioned CUDA entry point is the one `cuda.h`'s macros call); then by
spelling, so the choice never depends on the order a table lists them in.
"""

from __future__ import annotations

from collections.abc import Iterable

from pyctl.elf import STB_GLOBAL, STB_LOCAL, STB_WEAK

# st_info >> 4 -> rank, lower wins: a global over a weak over a local name
# (anything else after them: UNKNOWN_BIND).
BIND_RANK = {STB_GLOBAL: 0, STB_WEAK: 1, STB_LOCAL: 2}
UNKNOWN_BIND = 3


# Part of the disk cache's keys for tables that hold chosen names (symtab's
# "-names", resolve's "-sites"): bumped with any change of the order, so a
# table cached under an older order is read anew.
CACHE_TAG = "n3"

# CUDA's per-thread default stream twins of an entry point (cuMemcpyAsync_ptsz
# beside cuMemcpyAsync): the API's name is the plain one, as the catalog has it.
STREAM_TWINS = ("_ptsz", "_ptds")


def rank(name: str, bind: int = 0) -> tuple[bool, int, int, bool, int, str]:
    """The sort key of one name (lower is preferred); bind is a BIND_RANK value."""
    hidden = name.startswith("__GI_")  # glibc's internal alias of a public name
    versioned = "@" in name
    twin = name.endswith(STREAM_TWINS)
    under = len(name) - len(name.lstrip("_"))
    return (hidden or versioned, under, bind, twin, -len(name), name)


def ranked(names: Iterable[tuple[str, int]]) -> list[str]:
    """(name, bind rank) pairs of one address, best first, each name once
    (at its best rank)."""
    best: dict[str, tuple[bool, int, int, bool, int, str]] = {}
    for name, bind in names:
        key = rank(name, bind)
        if name not in best or key < best[name]:
            best[name] = key
    return sorted(best, key=best.__getitem__)


def canonical(names: Iterable[tuple[str, int]]) -> str:
    """The name of a function with these (name, bind rank) names."""
    out = ranked(names)
    if not out:
        raise ValueError("no names")
    return out[0]
