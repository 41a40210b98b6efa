"""Symbol tables a stack frame can trust: every function with its size,
from every place a distribution keeps them.

A frame is named only when its address lies inside a function's extent
[start, start + size). Taking the nearest symbol below the address, as
before, named `start_thread+0x305` in Debian's libc as
`pthread_condattr_setpshared+0x515` (a 30-byte function): libc's .dynsym
holds only exported names, and start_thread is not one. Where no function
contains the address the caller prints `lib+0xoffset`, never a wrong name.

Sources, merged (first the file itself, then its debug data):
- `.symtab` and `.dynsym` of the file;
- MiniDebugInfo: `.gnu_debugdata`, an xz-compressed ELF whose `.symtab`
  holds the local functions (Fedora, and Debian for some packages);
- a separate debug file by build-id, `/usr/lib/debug/.build-id/ab/cdef.debug`
  (Debian's -dbg/-dbgsym packages, e.g. libc6-dbg);
- `.gnu_debuglink`: the named file beside the library, in its `.debug/`, or
  under `/usr/lib/debug/<dir>/`.

Why not libdw or blazesym: libdw through ctypes needs elfutils on the target
host and its Dwfl API for a few lookups; blazesym has no Python binding on
PyPI. These four sources are what both of them read for symbol names, and
pyctl/elf.py (the one ELF reader) reads them. Tables are cached per file
(device, inode, mtime of the descriptor parsed), so one parse serves a
whole run.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyctl.elf import ElfError, ElfFile
from pyctl.elf import build_id as elf_build_id
from pyctl.symbols import names

DEBUG_ROOT = "/usr/lib/debug"
_BIND_RANK = names.BIND_RANK


@dataclass
class Table:
    """Functions of one ELF file, by start address (file vaddrs)."""

    path: str
    build_id: str = ""
    sources: list[str] = field(default_factory=list)  # where names came from
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    first_load: int = 0  # p_vaddr - p_offset of the lowest PT_LOAD
    others: dict[int, list[str]] = field(default_factory=dict)  # start -> other names

    def aliases(self, start: int) -> list[str]:
        """Every other name of the function at start (cuMemAlloc beside
        cuMemAlloc_v2, __GI___libc_malloc beside malloc)."""
        return list(self.others.get(start, ()))

    def lookup(self, vaddr: int) -> tuple[str, int] | None:
        """(name, offset into it) of the function containing vaddr, or None."""
        i = bisect.bisect_right(self.starts, vaddr) - 1
        # Nested or overlapping entries (a cold part inside a bigger one):
        # walk back a little for one whose extent holds vaddr.
        for j in range(i, max(i - 8, -1), -1):
            if self.starts[j] <= vaddr < self.ends[j]:
                return self.names[j], vaddr - self.starts[j]
        return None


_CACHE: dict[tuple[int, int, float], Table] = {}
# The last table read through each path: a process that dies right after
# its fault takes /proc/PID/root with it, so its libraries can no longer
# be stat'ed by that path; what was read while it lived still names them.
_BY_REAL: dict[str, Table] = {}
# Parsing this much ELF on the ring consumer's thread is a few ms; bigger
# files (libcuda, torch's: seconds) are left to `show` unless cached.
CHEAP_BYTES = 16 << 20
# Bumped whenever a table is read: a frame left unnamed may have a name now.
generation = 0


def _key(path: str) -> tuple[int, int, float]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_mtime


def is_loaded(path: str) -> bool:
    try:
        return _key(path) in _CACHE
    except OSError:
        return path in _BY_REAL


def cheap(path: str) -> bool:
    """Is reading path's table quick: read already, in the disk cache, or
    a small file? (What the ring consumer may parse without stalling.)"""
    if is_loaded(path):
        return True
    try:
        if os.stat(path).st_size <= CHEAP_BYTES:
            return True
    except OSError:
        return False
    # lazy: keeps pyctl.diskcache (pickle, +4 modules) off `--help`
    from pyctl import diskcache

    bid = elf_build_id(path)
    return bool(bid) and diskcache.has("symtab", f"{bid}-names-{names.CACHE_TAG}")


def _funcs(elf: ElfFile) -> list[tuple[int, int, str, int]]:
    """(start, end, name, binding rank) of the functions (STT_FUNC and
    STT_GNU_IFUNC) of .symtab and .dynsym."""
    rank = _BIND_RANK.get
    out = []
    for table in (".symtab", ".dynsym"):
        # A comprehension: libtorch_cpu.so has 380k functions in .symtab.
        out += [(v, v + sz, n, rank(i >> 4, 3)) for n, v, sz, i in elf.functions(table) if n]
    return out


def debug_candidates(path: str, build_id: str, link: str, root: str = "") -> list[str]:
    """Where a debug file of path may be: by build-id, then by debuglink."""
    out = []
    if len(build_id) > 2:
        out.append(f"{root}{DEBUG_ROOT}/.build-id/{build_id[:2]}/{build_id[2:]}.debug")
    if link:
        d = os.path.dirname(path)
        out += [f"{root}{d}/{link}", f"{root}{d}/.debug/{link}", f"{root}{DEBUG_ROOT}{d}/{link}"]
    if root and len(build_id) > 2:
        # A container's library of a build the host has the debug file of
        # (the same distribution's libc): a build-id names one build
        # wherever it lies, and debug_files checks the file's own.
        out.append(f"{DEBUG_ROOT}/.build-id/{build_id[:2]}/{build_id[2:]}.debug")
    return out


def debug_files(
    path: str, build_id: str, link: str, real: str, root: str = ""
) -> Iterator[tuple[str, ElfFile]]:
    """path's debug files of its own build (by build-id, then debuglink),
    each open while the caller looks at it; real: path's own file, never
    its own debug file. Names (here) and CFI (unwind.py) both read them."""
    for cand in debug_candidates(path, build_id, link, root):
        if not os.path.isfile(cand) or os.path.realpath(cand) == os.path.realpath(real):
            continue
        try:
            dbg = ElfFile.open(cand)
        except (OSError, ElfError):
            continue
        with dbg:
            if build_id and dbg.build_id not in ("", build_id):
                continue  # a debug file of another build: its names and CFI would lie
            yield cand, dbg


def load(path: str, root: str = "") -> Table:
    """The function table of path (as the target sees it; root: the
    target's /proc/PID/root for a container). Raises OSError/ElfError."""
    real = root + path if root else path
    try:
        f = ElfFile.open(real)
    except OSError:
        pinned = _BY_REAL.get(real)
        if pinned is None:
            raise
        return pinned
    with f:
        # The key of the bytes read through this descriptor, not of
        # whatever the path names a moment later.
        assert f.stat is not None
        key = f.stat.st_dev, f.stat.st_ino, f.stat.st_mtime
        t = _CACHE.get(key)
        if t is not None:
            _BY_REAL[real] = t
            return t
        t = _from_disk(path, root, f.build_id)
        if t is None:
            t = _parse(path, root, real, f)
    _CACHE[key] = _BY_REAL[real] = t
    global generation
    generation += 1
    return t


def _existing_debug(path: str, build_id: str, link: str, root: str) -> list[str]:
    """The debug-file candidates that exist now, as the target sees them:
    part of a cached table's validity (libc6-dbg installed since adds names)."""
    cands = debug_candidates(path, build_id, link, root)
    return [c[len(root) :] if root and c.startswith(root + "/") else c
            for c in cands if os.path.isfile(c)]  # fmt: skip


def _from_disk(path: str, root: str, bid: str) -> Table | None:
    """The table of this build from the disk cache, if its debug files are
    the ones present when it was made. Keyed by build-id: the same bytes at
    another path (or through another /proc/PID/root) are one entry."""
    # lazy: keeps pyctl.diskcache (pickle, +4 modules) off `--help`
    from pyctl import diskcache

    hit = diskcache.load_obj("symtab", f"{bid}-names-{names.CACHE_TAG}") if bid else None
    if not (isinstance(hit, tuple) and len(hit) == 3 and isinstance(hit[0], Table)):
        return None
    cached, link, debug = hit
    if cached.build_id != bid or _existing_debug(path, bid, link, root) != debug:
        return None
    return Table(path, bid, list(cached.sources), cached.starts, cached.ends, cached.names,
                 cached.first_load, cached.others)  # fmt: skip


def _parse(path: str, root: str, real: str, elf: ElfFile) -> Table:
    t = Table(path)
    entries: list[tuple[int, int, str, int]] = []
    t.first_load = elf.first_load
    t.build_id = elf.build_id
    own = _funcs(elf)
    if own:
        entries += own
        t.sources.append("symtab" if elf.section(".symtab") else "dynsym")
    mini = elf.minidebuginfo()
    if mini is not None:
        try:
            entries += _funcs(mini)
            t.sources.append("gnu_debugdata")
        except ElfError:
            pass
    link = elf.debuglink
    for cand, dbg in debug_files(path, t.build_id, link, real, root):
        try:
            extra = _funcs(dbg)
        except ElfError:
            continue
        if extra:
            entries += extra
            t.sources.append(cand)
            break
    # One name per start, the one every reader uses (pyctl/symbols/names.py:
    # the probe sites' names too). Sizes: the largest any source gives (a
    # .dynsym alias may say 0).
    best: dict[int, tuple[int, Any, str]] = {}
    for start, end, name, rank in entries:
        score = names.rank(name, rank)
        cur = best.get(start)
        if cur is None:
            best[start] = (end, score, name)
            continue
        cend, cscore, cname = cur
        end = max(end, cend)
        best[start] = (end, min(score, cscore), name if score < cscore else cname)
    names_at: dict[int, set[str]] = {}
    for start, _end, name, _rank in entries:
        names_at.setdefault(start, set()).add(name)
    for start in sorted(best):
        end, _score, name = best[start]
        if len(names_at[start]) > 1:
            t.others[start] = sorted(names_at[start] - {name})
        t.starts.append(start)
        t.ends.append(end if end > start else start + 1)  # size 0: its first byte only
        t.names.append(name)
    if t.build_id:
        # lazy: keeps pyctl.diskcache (pickle, +4 modules) off `--help`
        from pyctl import diskcache

        debug = _existing_debug(path, t.build_id, link, root)
        diskcache.store_obj("symtab", f"{t.build_id}-names-{names.CACHE_TAG}", (t, link, debug))
    return t


def name_at(path: str, rel: int, root: str = "", *, parse: bool = True) -> str | None:
    """'lib!function+0xoff' (demangled) for offset rel from path's load
    base; None when no function of the file contains it (the caller then
    prints 'lib+0xoff'), the file is unreadable, or parse=False and its
    table was not read yet."""
    # lazy: pyctl.symbols.demangle (ctypes, +4 modules) only when this runs
    from pyctl.symbols.demangle import demangle

    real = root + path if root else path
    if not parse and not is_loaded(real):
        return None
    try:
        t = load(path, root)
    except (OSError, ValueError):  # ElfError is a ValueError
        return None
    hit = t.lookup(rel + t.first_load)
    if hit is None:
        return None
    name, off = hit
    return f"{Path(path).name}!{demangle(name)}+{off:#x}"
