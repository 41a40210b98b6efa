"""System calls that keep the GIL, for the copilot's path while a target
thread is held (issue 26: "the 4-13 ms hold").

Every call through ctypes.CDLL or the os module releases the GIL and
takes it back after. In a controller whose other thread is busy in Python
(the ingest thread unwinding a fire's stack, writing its rows), taking it
back waits until that thread lets go: up to the interpreter's switch
interval (5 ms by default) per call. The copilot makes a dozen such calls
per fire (waitpid, the pending entry, getregs, peek, setregs, cont, the
Python stack's reads), and the target's thread stays stopped through all
of them: 4-13 ms per fire on the H200 in a threaded server against
0.14-0.30 ms in a plain loop. The pending entry's bpf(2) lookup is the
same kind of call, beside the other raw bpf(2) calls
(pyctl/bpf/raw.py map_lookup_and_delete_held).

These calls are short and never block (waitpid with WNOHANG, ptrace on a
stopped tracee, a read of /proc/PID/mem), so holding the GIL across them
costs the other threads microseconds. ctypes.PyDLL calls a C
function without releasing the GIL. The one blocking wait, sigtimedwait,
still releases it; fast_switch_begin() bounds what taking it back then
costs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

_libc = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

ptrace = _libc.ptrace
ptrace.restype = ctypes.c_long
ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]

_waitpid = _libc.waitpid
_waitpid.restype = ctypes.c_int
_waitpid.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int]

_pread = _libc.pread64
_pread.restype = ctypes.c_ssize_t
_pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64]


def _raise(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def waitpid(pid: int, flags: int) -> tuple[int, int]:
    """os.waitpid's (pid, status), holding the GIL: with WNOHANG only (it
    must not block). ChildProcessError when there is no child to wait for."""
    if not flags & os.WNOHANG:
        raise ValueError("heldcalls.waitpid must not block: pass WNOHANG")
    status = ctypes.c_int(0)
    got = _waitpid(pid, ctypes.byref(status), flags)
    if got < 0:
        err = ctypes.get_errno()
        if err == 10:  # ECHILD
            raise ChildProcessError(err, os.strerror(err))
        _raise("waitpid")
    return got, status.value


_bufs = threading.local()
_BUF = 4096  # a thread's reusable buffer: a Python stack's reads are 8-200 bytes


def pread(fd: int, n: int, offset: int) -> bytes:
    """os.pread, holding the GIL (a read of /proc/PID/mem)."""
    buf = getattr(_bufs, "buf", None) if n <= _BUF else ctypes.create_string_buffer(n)
    if buf is None:
        buf = _bufs.buf = ctypes.create_string_buffer(_BUF)
    got = _pread(fd, buf, n, offset)
    if got < 0:
        _raise(f"pread at {offset:#x}")
    return ctypes.string_at(buf, got)


# ---- the switch interval while a copilot runs -------------------------
#
# After sigtimedwait (which must release the GIL) the tracer takes the GIL
# back: with another thread busy in Python, after up to the switch
# interval. While any copilot runs, the interval is at most FAST_SWITCH_S
# (restored when the last one ends): the threads of a busy controller then
# hand the GIL on 10x as often, at a cost of a few microseconds each.
FAST_SWITCH_S = 0.0005
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


def fast_switch_begin() -> None:
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            if _switch_saved > FAST_SWITCH_S:
                sys.setswitchinterval(FAST_SWITCH_S)
        _switch_users += 1


def fast_switch_end() -> None:
    global _switch_users
    with _switch_lock:
        if _switch_users == 0:
            return
        _switch_users -= 1
        # Put back what was there, unless someone changed it meanwhile.
        ours = min(_switch_saved, FAST_SWITCH_S)
        if _switch_users == 0 and abs(sys.getswitchinterval() - ours) < 1e-7:
            sys.setswitchinterval(_switch_saved)
