"""A thin ctypes layer over ptrace(2) for the copilot (x86-64 only).

Only the requests the copilot uses. Every call raises OSError with the
errno (ProcessLookupError for ESRCH, PermissionError for EPERM), so callers
can tell "the thread is gone" from real failures. All requests for a tracee
must come from the thread that seized it (the kernel's rule, not ours).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Sequence

from pyctl import heldcalls

# Requests (linux/ptrace.h).
PTRACE_PEEKDATA = 2
PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_GETREGS = 12
PTRACE_SETREGS = 13
PTRACE_GETEVENTMSG = 0x4201
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_LISTEN = 0x4208

# Options.
PTRACE_O_TRACECLONE = 1 << 3
PTRACE_O_TRACEEXEC = 1 << 4

# Events, found in status >> 16 of a ptrace stop.
PTRACE_EVENT_CLONE = 3
PTRACE_EVENT_EXEC = 4
PTRACE_EVENT_STOP = 128

# waitpid flags that the os module does not export.
WALL = 0x40000000  # __WALL: threads and processes alike
WNOTHREAD = 0x20000000  # __WNOTHREAD: only this thread's tracees

# struct user_regs_struct (sys/user.h): the first 21 fields are struct
# pt_regs order, which is the order BPF records them in.
REG_NAMES = (
    "r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10", "r9", "r8", "ax", "cx", "dx",
    "si", "di", "orig_ax", "ip", "cs", "flags", "sp", "ss",
    "fs_base", "gs_base", "ds", "es", "fs", "gs",
)  # fmt: skip
NPTREGS = 21
REG = {name: i for i, name in enumerate(REG_NAMES)}


class UserRegs(ctypes.Structure):
    """The C layout, for reference and the layout test; the hot path uses struct."""

    _fields_ = [(name, ctypes.c_ulong) for name in REG_NAMES]


# Through pyctl/heldcalls.py: a ptrace request never blocks, and one that
# released the GIL would wait for it back behind a busy controller thread
# while the target's thread stays stopped (issue 26).
_ptrace = heldcalls.ptrace


def _call(req: int, tid: int, addr: int | None, data: int | ctypes._Pointer | None) -> int:
    ctypes.set_errno(0)
    ret = _ptrace(req, tid, addr, data)
    # PEEK* returns the word itself, so -1 is only an error when errno says so.
    if ret == -1:
        err = ctypes.get_errno()
        if err:
            raise OSError(err, f"ptrace({req:#x}, {tid}): {os.strerror(err)}")
    return ret


def seize(tid: int, options: int) -> None:
    _call(PTRACE_SEIZE, tid, None, options)


def interrupt(tid: int) -> None:
    _call(PTRACE_INTERRUPT, tid, None, None)


def cont(tid: int, sig: int = 0) -> None:
    _call(PTRACE_CONT, tid, None, sig)


def listen(tid: int) -> None:
    _call(PTRACE_LISTEN, tid, None, None)


def detach(tid: int, sig: int = 0) -> None:
    _call(PTRACE_DETACH, tid, None, sig)


def geteventmsg(tid: int) -> int:
    msg = ctypes.c_ulong(0)
    _call(PTRACE_GETEVENTMSG, tid, None, ctypes.addressof(msg))
    return msg.value


# One buffer per thread for GETREGS/SETREGS, converted with struct: much
# cheaper than building a Structure field by field (the copilot's latency).
_REGS_FMT = struct.Struct(f"={len(REG_NAMES)}Q")
_tls = threading.local()


def _regs_buf() -> tuple[bytearray, int]:
    try:
        return _tls.buf, _tls.addr
    except AttributeError:
        buf = bytearray(_REGS_FMT.size)
        _tls.buf = buf
        _tls.addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        return buf, _tls.addr


def getregs(tid: int) -> tuple[int, ...]:
    """All 27 registers of a stopped tracee, in REG_NAMES order."""
    buf, addr = _regs_buf()
    _call(PTRACE_GETREGS, tid, None, addr)
    return _REGS_FMT.unpack(buf)


def setregs(tid: int, regs: Sequence[int]) -> None:
    buf, addr = _regs_buf()
    _REGS_FMT.pack_into(buf, 0, *regs)
    _call(PTRACE_SETREGS, tid, None, addr)


def peekdata(tid: int, addr: int) -> int:
    """The 8-byte word at addr in the tracee, as an unsigned value."""
    return _call(PTRACE_PEEKDATA, tid, addr, None) & 0xFFFFFFFFFFFFFFFF
