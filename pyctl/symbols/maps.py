"""A process's mappings as a fire saw them, and where each file's offset 0
sits in them (its load base): what the unwinder (pyctl/symbols/unwind.py)
and the map watch (pyctl/symbols/mapwatch.py) share.

Kept apart from the unwinder so that watching a process's mappings at
attach costs a read of each file's program headers, not an import of the
CFI decoder and a parse of its .eh_frame: those wait for the first fire
that copies a stack (bench/bench_attach.py measures the start-up).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyctl import elf

Loads = list[tuple[int, int, int, int]]  # (p_offset, p_vaddr, p_filesz, p_flags)


@dataclass(frozen=True)
class Mapping:
    lo: int
    hi: int
    offset: int  # file offset of lo
    perms: str  # "r-xp"
    path: str  # as the target sees it ('' for anonymous)
    dev: int = 0  # the mapped file's device (os.makedev) and inode; 0: not known
    ino: int = 0

    @property
    def executable(self) -> bool:
        return "x" in self.perms


class Maps:
    """A process's mappings as they were at a fire (pyctl/symbols/mapwatch.py
    keeps them current), searchable by address."""

    def __init__(self, maps: Sequence[Mapping], root: str = "") -> None:
        """root: the process's /proc/PID/root when it is not ours (a
        container, a chroot): its paths are opened through it."""
        self.maps = sorted(maps, key=lambda m: m.lo)
        self.root = root
        self._opened: dict[str, str] = {}
        self._los = [m.lo for m in self.maps]
        # path -> the unwinder's FileCfi (or None): one stat per module per
        # fire, not per frame (unwind.unwind fills it).
        self.cfi_memo: dict[str, Any] = {}
        self._bases: dict[str, int] = {}

    def find(self, addr: int) -> Mapping | None:
        i = bisect.bisect_right(self._los, addr) - 1
        if i >= 0 and addr < self.maps[i].hi:
            return self.maps[i]
        return None

    def opened(self, path: str) -> str:
        """Where this process's file `path` is opened from here: through its
        root; where what lies at that path now is not the file mapped there
        (a file mounted over it, one swapped in since), the kernel's handle
        on the mapped file (/proc/PID/map_files/RANGE) while it lives."""
        if not self.root or not path.startswith("/"):
            return path
        hit = self._opened.get(path)
        if hit is None:
            hit = self._opened[path] = self._verified(path)
        return hit

    def _verified(self, path: str) -> str:
        cand = self.root + path
        ms = [m for m in self.maps if m.path == path and m.ino]
        if not ms:
            return cand
        try:
            st = os.stat(cand)
            if any((st.st_dev, st.st_ino) == (m.dev, m.ino) for m in ms):
                return cand
        except OSError:
            pass
        proc = self.root.removesuffix("/root")
        for m in ms:
            handle = f"{proc}/map_files/{m.lo:x}-{m.hi:x}"
            try:
                st = os.stat(handle)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (m.dev, m.ino):
                return handle
        return cand

    def exec_at(self, addr: int) -> Mapping | None:
        m = self.find(addr)
        return m if m is not None and m.executable and m.path else None

    def load_base(self, path: str) -> int:
        """Where the file's offset 0 would be mapped: what symtab's offsets
        (and the stacks table's) are relative to. From any one mapping
        and the file's segments (perf reports only the executable one, at
        a file offset that is not its vaddr in, e.g., a Rust wheel's .so)."""
        if path not in self._bases:
            self._bases[path] = min(
                (mapping_base(m, opened=self.opened(path)) for m in self.maps if m.path == path),
                default=0,
            )
        return self._bases[path]


_LOADS_BY_KEY: dict[tuple[int, int, float], Loads] = {}
_LOADS_BY_PATH: dict[str, Loads] = {}  # the last read through a path: it may be gone


def file_loads(path: str) -> Loads:
    """path's PT_LOAD segments (program headers only), cached by inode and
    by path (a target killed by its fault takes its /proc/PID/root with
    it); [] when it cannot be read."""
    try:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_mtime)
    except OSError:
        return _LOADS_BY_PATH.get(path, [])
    hit = _LOADS_BY_KEY.get(key)
    if hit is None:
        try:
            with elf.ElfFile.open(path) as f:
                hit = [(s.offset, s.vaddr, s.filesz, s.flags) for s in f.loads]
        except Exception:  # noqa: BLE001 - not ELF, unreadable: no segments known
            return []
        _LOADS_BY_KEY[key] = hit
    _LOADS_BY_PATH[path] = hit
    return hit


def perm_flags(perms: str) -> int:
    """A maps line's "r-xp" as PT_LOAD's p_flags (PF_R 4, PF_W 2, PF_X 1)."""
    p = (perms + "---")[:3]
    return (4 if p[0] == "r" else 0) | (2 if p[1] == "w" else 0) | (1 if p[2] == "x" else 0)


def segment_delta(path: str, file_off: int, perms: str = "") -> int:
    """(p_vaddr - p_offset) of the PT_LOAD a mapping at file_off maps,
    less that of the lowest PT_LOAD: how far a mapping's (lo - offset) is
    from the file's load base. 0 where the file is unknown or its
    segments agree.

    A mapping with no access at all ("---p") is no segment's: it is a
    hole the loader left in its first mapping of the whole file (between
    segments whose vaddr gaps are larger than their file gaps, as
    libcuda's are), so it sits at base + offset. Its offset often is the
    next segment's first page, which made that segment's delta apply and
    the base come out 2 MiB low (issue 22: libcuda frames named 0x200000
    past the function). Where a page belongs to two segments, the one
    whose flags are the mapping's permissions is the one mapped there."""
    if perms and perm_flags(perms) == 0:
        return 0
    loads = file_loads(path) if path.startswith("/") else []
    if not loads:
        return 0
    first = min(loads, key=lambda x: x[1])
    # A segment's mapping starts at its p_offset rounded down to a page,
    # which the previous segment's last page may hold too.
    holding = [x for x in loads if x[0] & ~0xFFF <= file_off < x[0] + max(x[2], 1)]
    if not holding:
        return 0
    want = perm_flags(perms) if perms else None
    off, vaddr, _size, _flags = min(
        holding, key=lambda x: (x[0] & ~0xFFF != file_off, want is not None and x[3] != want)
    )
    return (vaddr - off) - (first[1] - first[0])


def mapping_base(m: Mapping, root: str = "", opened: str = "") -> int:
    """Where the file of mapping m has its offset 0 (its load base), from
    this one mapping and the file's segments (read from `opened`, else
    through root: the process's /proc/PID/root when it is not ours)."""
    path = opened or (root + m.path if root and m.path.startswith("/") else m.path)
    return m.lo - m.offset - segment_delta(path, m.offset, m.perms)
