"""The kernel's uprobe registration, warmed up while a trace starts (issue 26).

Registering a uprobe (a uprobe_multi link, a perf uprobe) takes the
kernel's dup_mmap_sem for writing, a per-CPU rw-semaphore: the first
writer after a quiet spell waits for an RCU grace period (rcu_sync),
5-15 ms on the 2-vCPU dev VM, which was nearly all of a trace's attach
(the entry link: 5-15 ms; the return link right after it: 0.05 ms). A
writer within about a grace period of the last one's end skips the wait.

So when a trace starts (its early load, pyctl/bpf/main_object.py; a
served controller's early attach, pyctl/early.py), a thread registers a
uprobe no process can hit, a disabled perf uprobe on the BPF object file
(no process maps it as code: no breakpoint is written anywhere), and a
few more, each about one grace period (the first one's wait) after the
last, while the main thread imports the engine and resolves: its own
registration, 20-60 ms later, then finds the semaphore warm (0.05-0.1 ms
measured). Few on purpose: closing a perf uprobe waits for grace periods
of its own (60-150 ms each seen under load), which the thread does after
the run's probes are in (done()), and a process that exits first pays
at its exit. Best effort: where perf uprobes are
refused nothing is warmed and nothing is said. GPUFAULT_NO_WARMUP=1
turns it off.
"""

from __future__ import annotations

import ctypes as C
import os
import struct
import threading
import time
from typing import Any

# perf_event_open(2): the syscall number by machine (the wheel is x86-64).
_NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
_PMU_TYPE = "/sys/bus/event_source/devices/uprobe/type"
PERF_FLAG_FD_CLOEXEC = 8
COUNT = 4  # registrations: the first waits the grace period, the rest keep it warm
MIN_EVERY_S = 0.003  # apart: the first one's wait (a grace period), at least this
MAX_S = 2.0  # a start that never says done() (it failed) closes them here


class Warmup:
    """One start's dummy registrations, made and closed by its thread.
    Everything but the syscalls is prepared here, on the caller's thread:
    the warm-up thread holds the GIL for as little as it can (each time it
    wants it back, the importing main thread may wait for it)."""

    def __init__(self, path: str) -> None:
        self.fds: list[int] = []
        self._done = threading.Event()
        self._path = C.create_string_buffer(os.fsencode(path))
        self._attr = C.create_string_buffer(128)
        self._syscall: Any = None
        try:
            self._nr = _NR_PERF_EVENT_OPEN[os.uname().machine]
            with open(_PMU_TYPE) as f:
                pmu = int(f.read())
            self._syscall = C.CDLL(None, use_errno=True).syscall
            self._syscall.restype = C.c_long
        except (KeyError, OSError, ValueError):
            pmu = 0
        # type, size, config (0: an entry probe), then flags at 40 (bit 0:
        # disabled: it counts nothing); config1 (the path) at 56, config2
        # (the offset) at 64.
        struct.pack_into("=IIQ", self._attr, 0, pmu, 128, 0)
        struct.pack_into("=Q", self._attr, 40, 1)
        struct.pack_into("=QQ", self._attr, 56, C.addressof(self._path), 0)
        self.thread = threading.Thread(target=self._run, name="gf-uprobe-warmup", daemon=True)

    def _open(self) -> bool:
        # pid -1, cpu 0: any process on CPU 0 (a registration with no task
        # filter; no process maps the file as code, so none is probed).
        fd = self._syscall(self._nr, self._attr, -1, 0, -1, PERF_FLAG_FD_CLOEXEC)
        if fd < 0:
            return False
        self.fds.append(fd)
        return True

    def _run(self) -> None:
        try:
            every = 0.0
            for _ in range(COUNT if self._syscall is not None else 0):
                t0 = time.monotonic()
                if not self._open():
                    break
                # The semaphore stays warm about one grace period after a
                # writer: the first registration's wait is one.
                every = every or max(MIN_EVERY_S, time.monotonic() - t0)
                if self._done.wait(every):
                    break
            self._done.wait(MAX_S)
        finally:
            fds, self.fds = self.fds, []
            for fd in fds:
                os.close(fd)

    def done(self) -> None:
        """The run's probes are in (or it will attach none): stop."""
        self._done.set()


_current: Warmup | None = None


def start(path: str) -> None:
    """Warm up from now until done(); path: a file no process maps as code."""
    global _current
    if _current is not None or os.environ.get("GPUFAULT_NO_WARMUP"):
        return
    _current = Warmup(path)
    _current.thread.start()


def done(wait: bool = False) -> None:
    """Stop warming (the probes are in); the dummies close on the thread
    (wait: before this returns, for a caller that counts descriptors)."""
    global _current
    w, _current = _current, None
    if w is not None:
        w.done()
        if wait:
            w.thread.join()
