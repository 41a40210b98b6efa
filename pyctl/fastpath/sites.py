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


FAIL, STALL = 0, 1  # enum gfsig_kind


@dataclass(frozen=True)
class Site:
    rip_after: int
    sp_delta: int
    retval: int
    err: int
    kind: int = FAIL
    stall_ns: int = 0


class SiteError(ValueError):
    pass


def _modrm_len(b: bytes, i: int) -> int:
    """Bytes of the ModRM at b[i] with its SIB and displacement."""
    modrm = b[i]
    mod, rm = modrm >> 6, modrm & 7
    if mod == 3:
        return 1
    n = 1
    if rm == 4:  # SIB
        n += 1
        if mod == 0 and b[i + 1] & 7 == 5:
            n += 4
    elif mod == 0 and rm == 5:  # rip-relative
        n += 4
    return n + (1 if mod == 1 else 4 if mod == 2 else 0)


def decode(code: bytes) -> tuple[int, int]:
    """(length, sp delta) of the first instruction in code, or SiteError.
    sp delta: entry sp = sp after the instruction + delta. Taken: pushes,
    endbr64, nop, sub $imm,%rsp, and instructions that write only flags or a
    caller-saved register (loads, compares, tests, mov $imm, xor): the
    skip then needs no register but rsp and rip put back."""
    b = code
    if b[:4] == b"\xf3\x0f\x1e\xfa":  # endbr64
        return 4, 0
    if b[0] == 0x90:  # nop
        return 1, 0
    if 0x50 <= b[0] <= 0x57:  # push r64
        return 1, 8
    if b[0] == 0x41 and 0x50 <= b[1] <= 0x57:  # push r8-r15
        return 2, 8
    i, rex = 0, 0
    if 0x40 <= b[0] <= 0x4F:
        i, rex = 1, b[0]
    op = b[i]
    if op in (0x83, 0x81) and b[i + 1] == 0xEC and rex & 8:  # sub $imm,%rsp
        if op == 0x83:
            return i + 3, struct.unpack("b", b[i + 2 : i + 3])[0]
        return i + 6, struct.unpack("<i", b[i + 2 : i + 6])[0]
    if 0xB8 <= op <= 0xBF:  # mov $imm,%reg
        if (op & 7) | ((rex & 1) << 3) in _SCRATCH:
            return i + 1 + (8 if rex & 8 else 4), 0
    elif op in (0x89, 0x8B, 0x31, 0x33, 0x39, 0x3B, 0x85, 0x80, 0x81, 0x83, 0xF6, 0xF7):
        modrm = b[i + 1]
        reg = ((modrm >> 3) & 7) | ((rex & 4) << 1)
        rm = (modrm & 7) | ((rex & 1) << 3)
        n = i + 1 + _modrm_len(b, i + 1)
        if op in (0x39, 0x3B, 0x85):  # cmp, test: flags only
            return n, 0
        if op in (0x80, 0x81, 0x83, 0xF6, 0xF7):  # group 1 cmp, group 3 test
            sub = (modrm >> 3) & 7
            imm = 1 if op in (0x80, 0x83, 0xF6) else 4
            if (op in (0x80, 0x81, 0x83) and sub == 7) or (op in (0xF6, 0xF7) and sub == 0):
                return n + imm, 0
        elif op == 0x8B and reg in _SCRATCH:  # load into a scratch register
            return n, 0
        elif op in (0x89, 0x31) and modrm >> 6 == 3 and rm in _SCRATCH:
            return n, 0  # mov/xor reg -> scratch reg
        elif op == 0x33 and modrm >> 6 == 3 and reg in _SCRATCH:
            return n, 0
    raise SiteError(f"first instruction {code[:8].hex(' ')} is not one the signal path knows")


def read_insn(path: str, offset: int) -> bytes:
    """16 bytes at a file offset of a library (the file: memory holds the
    uprobe's int3 there)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, 16, offset)
    finally:
        os.close(fd)
