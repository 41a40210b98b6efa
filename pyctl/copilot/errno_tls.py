"""Where a thread's errno lives, so the copilot can set it with a fail.

errno is thread-local: glibc's `__errno_location()` is
`mov errno@GOTTPOFF(%rip), %rax; add %fs:0, %rax`. The GOT slot holds
errno's offset from the thread pointer (an R_X86_64_TPOFF64 relocation
against libc's TLS symbol `errno`, filled in by the dynamic linker; the
same in every thread, as libc's TLS block is in the static TLS area), and
%fs:0 is the thread pointer, which ptrace gives as the thread's fs_base.
So a stopped thread's errno is at fs_base + the slot's value: found from
libc's relocations and one 8-byte read of the target's GOT, without
running code in the target (calling `__errno_location()` in the stopped
thread would need a breakpoint, a second stop and a register restore for
what two reads give).

Refused, with one line, where this layout is not there: no glibc
`libc.so.6` mapped (a static binary, musl), or a libc without the
`errno` TLS symbol or its TPOFF64 slot.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from pyctl import elf
from pyctl.exceptions import GpufaultError

R_X86_64_TPOFF64 = 18
STT_TLS = 6
# libc's static TLS block sits below the thread pointer (x86-64's TLS
# variant II): a negative offset, far smaller than this.
MAX_TPOFF = 1 << 24


class ErrnoError(GpufaultError):
    """errno cannot be located in this process (one line)."""


@dataclass(frozen=True)
class LibcMap:
    path: str  # as the target sees it
    base: int  # load base (address of file vaddr 0)


def _libc_map(pid: int) -> LibcMap:
    """glibc's libc.so.6 in the target's maps, and where it is loaded."""
    try:
        lines = open(f"/proc/{pid}/maps").read().splitlines()
    except OSError as e:
        raise ErrnoError(f"pid {pid}: cannot read its maps ({e.strerror})") from None
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or os.path.basename(parts[5]) != "libc.so.6":
            continue
        start = int(parts[0].split("-")[0], 16)
        pgoff = int(parts[2], 16)
        # The first mapping of the file (lowest address): vaddr == offset
        # for a shared object's first PT_LOAD, so base = start - pgoff.
        return LibcMap(parts[5], start - pgoff)
    raise ErrnoError(
        f"pid {pid} has no glibc libc.so.6 mapped (a static binary or another libc): "
        "--errno cannot find its errno"
    )


# (dev, inode, mtime) -> the slot's vaddr: one libc file, whatever path
# (the host's, /proc/PID/root/...) reaches it.
_SLOTS: dict[tuple[int, int, float], int] = {}


def slot_vaddr(real: str) -> int:
    """The vaddr of libc's GOT slot holding errno's TLS offset, for the
    file at real (read once per file). Raises ErrnoError."""
    try:
        st = os.stat(real)
    except OSError as e:
        raise ErrnoError(f"cannot open {real} ({e.strerror})") from None
    key = (st.st_dev, st.st_ino, st.st_mtime)
    if key not in _SLOTS:
        _SLOTS[key] = _slot(real)
    return _SLOTS[key]


def _slot(real: str) -> int:
    try:
        with elf.ElfFile.open(real) as f:
            index, value = -1, -1
            for i, sym in enumerate(f.symbols(".dynsym")):
                if sym.name == "errno" and sym.type == STT_TLS and sym.shndx:
                    index, value = i, sym.value
                    break
            if index < 0:
                raise ErrnoError(f"{real} has no errno TLS symbol: not glibc's libc")
            for sec in f.sections:
                for off, sym_i, rtype, addend in f.relocations(sec):
                    if rtype != R_X86_64_TPOFF64:
                        continue
                    # Against the symbol, or (libc's own, local) against
                    # none with errno's offset in the TLS block as addend.
                    if sym_i == index or (sym_i == 0 and addend == value):
                        return int(off)
    except (OSError, elf.ElfError) as e:
        raise ErrnoError(f"cannot read {real}: {e}") from None
    raise ErrnoError(f"{real}: no TPOFF64 relocation for errno (an unusual libc build)")


def tls_offset(pid: int) -> int:
    """errno's offset from the thread pointer in pid (the same for all its
    threads). Raises ErrnoError."""
    lm = _libc_map(pid)
    addr = lm.base + slot_vaddr(f"/proc/{pid}/root{lm.path}")
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        try:
            raw = os.pread(fd, 8, addr)
        finally:
            os.close(fd)
    except OSError as e:
        raise ErrnoError(f"pid {pid}: cannot read libc's GOT at {addr:#x} ({e.strerror})") from None
    (tpoff,) = struct.unpack("<q", raw.ljust(8, b"\0"))
    if not -MAX_TPOFF < tpoff < 0:
        raise ErrnoError(f"pid {pid}: errno's TLS offset reads {tpoff:#x}: not a static TLS slot")
    return int(tpoff)


def open_mem(pid: int) -> int:
    """A descriptor for writing pid's memory (every thread shares it).
    Raises OSError."""
    return os.open(f"/proc/{pid}/mem", os.O_WRONLY | os.O_CLOEXEC)


def write_errno(mem_fd: int, addr: int, value: int) -> None:
    """Store value (a C int) at addr through open_mem's descriptor, while
    the thread whose errno it is is stopped. Raises OSError."""
    if os.pwrite(mem_fd, struct.pack("<i", value), addr) != 4:
        raise OSError(f"short write at {addr:#x}")
