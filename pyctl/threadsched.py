"""How a thread asks the kernel to run it on time: a load thread
(experiment/loadgen.OpenLoopLoad), the copilot's tracer (copilot/tracer.py).

First choice, SCHED_FIFO at a low real-time priority: it preempts every
normal thread the moment its timer or futex fires. That needs
CAP_SYS_NICE, which root in a container often lacks (the GPU host's root
here has not got it). Second choice, unprivileged: a short EEVDF slice
(`sched_setattr` with `sched_runtime` on a SCHED_OTHER thread, Linux
6.12+): a thread asking for 0.1 ms slices gets earlier virtual deadlines,
so the fair scheduler lets it preempt a busy thread on wake-up instead of
after that thread's default slice (0.75 ms x (1 + log2 CPUs), 3.75 ms on
16 CPUs: the 3.9 ms scheduling error measured there with every core busy).
Older kernels accept the call and ignore the slice, so it is read back
(`sched_getattr`) before it counts.

Both apply to the calling thread only (pid 0: Linux schedules threads).
"""

from __future__ import annotations

import ctypes
import os
import struct

FIFO_PRIORITY = 10  # above every normal thread, below the kernel's own RT threads
SLICE_NS = 100_000  # EEVDF's smallest custom slice (0.1 ms)

# struct sched_attr, SCHED_ATTR_SIZE_VER1 (include/uapi/linux/sched/types.h):
# size, policy, flags, nice, priority, runtime, deadline, period, util_min, util_max
_ATTR = struct.Struct("=IIQiIQQQII")
_NR = {"x86_64": (314, 315), "aarch64": (274, 275)}  # sched_setattr, sched_getattr
_libc: ctypes.CDLL | None = None


def _syscall(nr: int, buf: ctypes.Array[ctypes.c_char], *rest: int) -> int:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    r = int(_libc.syscall(nr, 0, buf, *rest))
    return 0 if r == 0 else ctypes.get_errno()


def fifo() -> str | None:
    """SCHED_FIFO for this thread; None, or why not. With
    SCHED_RESET_ON_FORK: a process this thread forks starts normal."""
    try:
        policy = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
        os.sched_setscheduler(0, policy, os.sched_param(FIFO_PRIORITY))
    except OSError as e:
        return e.strerror or str(e)
    return None


def short_slice(ns: int = SLICE_NS) -> str | None:
    """A SCHED_OTHER thread with an `ns` EEVDF slice; None, or why not."""
    nrs = _NR.get(os.uname().machine)
    if nrs is None:
        return f"no sched_setattr number known for {os.uname().machine}"
    set_nr, get_nr = nrs
    buf = ctypes.create_string_buffer(_ATTR.pack(_ATTR.size, 0, 0, 0, 0, ns, 0, 0, 0, 0))
    err = _syscall(set_nr, buf, 0)
    if err:
        return os.strerror(err)
    out = ctypes.create_string_buffer(_ATTR.size)
    err = _syscall(get_nr, out, _ATTR.size, 0)
    if err:
        return os.strerror(err)
    if _ATTR.unpack(out.raw)[5] != ns:
        return "this kernel has no custom slices (Linux 6.12+)"
    return None


def prioritize() -> str:
    """This thread on time as far as the kernel allows: "fifo", or
    "other, 0.1 ms slice (SCHED_FIFO: why)", or "other (both whys)"."""
    why_fifo = fifo()
    if why_fifo is None:
        return "fifo"
    why_slice = short_slice()
    if why_slice is None:
        return f"other, {SLICE_NS / 1e6:g} ms slice (SCHED_FIFO: {why_fifo})"
    return f"other (SCHED_FIFO: {why_fifo}; slice: {why_slice})"


__all__ = ["FIFO_PRIORITY", "SLICE_NS", "fifo", "prioritize", "short_slice"]
