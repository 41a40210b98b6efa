"""Probe sites as the signal path's handler needs them: where the thread is
when the signal arrives (the site plus its first instruction, which the
uprobe has emulated or single-stepped) and how far that instruction moved
the stack pointer, so the handler can recompute the entry sp.

Only instructions whose effect on rsp is fixed and that write no
callee-saved register are taken; any other site is a FastpathError and
the run goes through the copilot, which restores every register.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

# Caller-saved registers by number (rax rcx rdx rsi rdi r8-r11): a first
# instruction may write these, never rbx/rbp/rsp/r12-r15.
_SCRATCH = {0, 1, 2, 6, 7, 8, 9, 10, 11}


@dataclass(frozen=True)
class Site:
    rip_after: int
    sp_delta: int
    retval: int
    err: int


class SiteError(ValueError):
    pass


def decode(code: bytes) -> tuple[int, int]:
    """(length, sp delta) of the first instruction in code, or SiteError.
    sp delta: entry sp = sp after the instruction + delta."""
    b = code
    if b[:4] == b"\xf3\x0f\x1e\xfa":  # endbr64
        return 4, 0
    if b[0] == 0x90:  # nop
        return 1, 0
    if 0x50 <= b[0] <= 0x57:  # push r64
        return 1, 8
    if b[0] == 0x41 and 0x50 <= b[1] <= 0x57:  # push r8-r15
        return 2, 8
    if b[0] in (0x48, 0x49, 0x4C, 0x4D) and len(b) >= 3:
        rex, op, modrm = b[0], b[1], b[2]
        if op == 0x83 and modrm == 0xEC and len(b) >= 4:  # sub $imm8,%rsp
            return 4, struct.unpack("b", b[3:4])[0]
        if op == 0x81 and modrm == 0xEC and len(b) >= 7:  # sub $imm32,%rsp
            return 7, struct.unpack("<i", b[3:7])[0]
        if op in (0x89, 0x8B) and modrm >> 6 == 3:  # mov reg,reg
            reg = ((modrm >> 3) & 7) | ((rex & 4) << 1)
            rm = (modrm & 7) | ((rex & 1) << 3)
            dest = rm if op == 0x89 else reg
            if dest in _SCRATCH:
                return 3, 0
    raise SiteError(f"first instruction {code[:8].hex(' ')} is not one the signal path knows")


def read_insn(path: str, offset: int) -> bytes:
    """16 bytes at a file offset of a library (the file: memory holds the
    uprobe's int3 there)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, 16, offset)
    finally:
        os.close(fd)
