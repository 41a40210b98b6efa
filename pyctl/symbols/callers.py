"""Where a caller object lives in a process: the address range the BPF
caller filter compares a call's return address with (`--caller OBJ`).

A uprobe on a C library function fires for every call of it, also the
library's own internal ones (`read` under `fgets`, `malloc` under
`fopen`), so `inject --fn read --every 1` once failed the target's reads
of stdin. `--caller` limits a fault to calls whose return address lies in
one object: the application binary (`--caller main`), libtorch, a plugin.

`--caller OBJ+0xOFF` names one call site: the return address at offset
OFF of OBJ as a stack frame's `module` and `offset` in the evidence name
it (`gpufault explore`'s points): OBJ's ELF address (address minus load
bias), which is the file offset only where the code segment's address and
file offset agree (a plain gcc/ld build; lld and Rust's cdylibs put code
a page further in memory than in the file). The filter is then that one
address: only the calls made from that instruction fire.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass

from pyctl import elf
from pyctl.procstate import proc_dir
from pyctl.targets.procfs import chroot_prefix, in_view


class CallerError(ValueError):
    """One line for the user: which object, what to do."""


@dataclass(frozen=True)
class Range:
    path: str
    lo: int
    hi: int


_SITE = re.compile(r"(?P<name>.+)\+0x(?P<off>[0-9a-fA-F]+)")


def split_site(caller: str) -> tuple[str, int | None]:
    """`OBJ+0xOFF` -> (OBJ, OFF); any other caller -> (caller, None)."""
    m = _SITE.fullmatch(caller)
    if m is None:
        return caller, None
    return m["name"], int(m["off"], 16)


def _exec_maps(pid: int) -> list[tuple[int, int, str]]:
    return [(lo, hi, path) for lo, hi, _off, path in _exec_maps_off(pid)]


def _exec_maps_off(pid: int) -> list[tuple[int, int, int, str]]:
    out = []
    try:
        # A live thread's maps when main has exited (pthread_exit).
        with open(f"{proc_dir(pid)}/maps") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise CallerError(f"cannot read /proc/{pid}/maps: {e.strerror}") from None
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or "x" not in parts[1] or not parts[5].startswith("/"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append((lo, hi, int(parts[2], 16), parts[5].removesuffix(" (deleted)")))
    # A chroot in our mounts: its files as it names them (resolve's view).
    pre = chroot_prefix(pid)
    return [(lo, hi, off, in_view(p, pre)) for lo, hi, off, p in out] if pre else out


def _matches(name: str, path: str, exe: str) -> bool:
    base = os.path.basename(path)
    if name in ("main", "exe"):
        return path == exe
    if "/" in name:
        return path == name or os.path.realpath(name) == path
    if any(c in name for c in "*?["):
        return fnmatch.fnmatch(base, name)
    # libc: libc.so.6, libc-2.31.so; never libcuda.so (a different library).
    return base == name or base.startswith((name + ".", name + "-"))


def exec_range(pid: int, name: str) -> Range | None:
    """The executable mappings of the one object `name` names in pid, as
    one [lo, hi) range (an object's segments are contiguous); None when it
    is not mapped (yet). CallerError when name matches several objects.
    `OBJ+0xOFF`: the one return address at file offset OFF of OBJ, as a
    range of one byte; CallerError when no executable mapping holds OFF."""
    name, site = split_site(name)
    try:
        exe = in_view(os.readlink(f"{proc_dir(pid)}/exe").removesuffix(" (deleted)"),
                      chroot_prefix(pid))  # fmt: skip
    except OSError:
        exe = ""
    hits: dict[str, list[tuple[int, int, int]]] = {}
    for lo, hi, off, path in _exec_maps_off(pid):
        if _matches(name, path, exe):
            hits.setdefault(path, []).append((lo, hi, off))
    if not hits:
        return None
    if len(hits) > 1:
        raise CallerError(f"--caller {name!r} matches {len(hits)} objects in pid {pid} "
                          f"({', '.join(sorted(os.path.basename(p) for p in hits))}): "
                          "give a longer name or the full path")  # fmt: skip
    ((path, spans),) = hits.items()
    if site is not None:
        foff = _file_offset(pid, spans, site)
        for lo, hi, off in spans:
            if off <= foff < off + (hi - lo):
                ra = lo + foff - off
                return Range(path, ra, ra + 1)
        raise CallerError(
            f"--caller {name}+{site:#x}: no executable mapping of {path} in "
            f"pid {pid} holds file offset {site:#x}: give the offset of a "
            "return address in its code (a stack frame's offset)"
        )
    return Range(path, min(lo for lo, _, _ in spans), max(hi for _, hi, _ in spans))


def _file_offset(pid: int, spans: list[tuple[int, int, int]], vaddr: int) -> int:
    """The file offset of OBJ's ELF address vaddr, read from its PT_LOADs
    through /proc/PID/map_files (the very file mapped, whatever its path
    names now); vaddr itself when the headers cannot be read."""
    lo, hi, _ = spans[0]
    try:
        with elf.ElfFile.open(f"{proc_dir(pid)}/map_files/{lo:x}-{hi:x}") as f:
            for seg in f.loads:
                if seg.vaddr <= vaddr < seg.vaddr + seg.filesz:
                    return vaddr - seg.vaddr + seg.offset
    except (OSError, elf.ElfError):
        pass
    return vaddr
