"""The kernel's uprobe registration, warmed up while a run starts (issue 26).

Registering a uprobe (a uprobe_multi link, a perf uprobe) takes the
kernel's dup_mmap_sem for writing, a per-CPU rw-semaphore: the first
writer after a quiet spell waits for an RCU grace period (rcu_sync),
5-15 ms on the 2-vCPU dev VM, which was nearly all of a trace's attach
(the entry link: 5-15 ms, the return link right after it: 0.05 ms). A
writer within about a grace period of the last one skips the wait. So
from the early load on (pyctl/bpf/main_object.py start_early) a thread
registers a uprobe no process can hit, every few milliseconds, until the
run's own probes are in (done()): a perf uprobe on the BPF object file,
which no process maps as code, so no breakpoint is written anywhere. The
run's registration then finds the semaphore warm (0.05-0.1 ms measured).
The thread closes its dummies afterwards (each close waits a grace
period of its own, off the way to the first call). Best effort: where
perf uprobes are refused, nothing is warmed and nothing is said.
GPUFAULT_NO_WARMUP=1 turns it off.
"""

from __future__ import annotations

import ctypes as C
import os
import struct
import threading

# perf_event_open(2): the syscall number by machine (the wheel is x86-64).
_NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
_PMU_TYPE = "/sys/bus/event_source/devices/uprobe/type"
PERF_FLAG_FD_CLOEXEC = 8
EVERY_S = 0.003  # well inside a grace period: the semaphore never cools
MAX_S = 2.0  # a start that never says done() (it failed) stops here


class Warmup:
    def __init__(self, path: str) -> None:
        self.path = C.create_string_buffer(os.fsencode(path))
        self.fds: list[int] = []
        self._done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="gf-uprobe-warmup", daemon=True)

    def _open(self, syscall: C._FuncPointer, nr: int, pmu: int) -> bool:
        attr = C.create_string_buffer(128)
        # type, size, config (0: an entry probe), then flags at 40 (bit 0:
        # disabled: it counts nothing); config1 (the path) at 56, config2
        # (the offset) at 64.
        struct.pack_into("=IIQ", attr, 0, pmu, 128, 0)
        struct.pack_into("=Q", attr, 40, 1)
        struct.pack_into("=QQ", attr, 56, C.addressof(self.path), 0)
        fd = syscall(nr, attr, -1, 0, -1, PERF_FLAG_FD_CLOEXEC)
        if fd < 0:
            return False
        self.fds.append(fd)
        return True

    def _run(self) -> None:
        try:
            nr = _NR_PERF_EVENT_OPEN[os.uname().machine]
            with open(_PMU_TYPE) as f:
                pmu = int(f.read())
            syscall = C.CDLL(None, use_errno=True).syscall
            syscall.restype = C.c_long
            waited = 0.0
            while self._open(syscall, nr, pmu) and waited < MAX_S:
                if self._done.wait(EVERY_S):
                    break
                waited += EVERY_S
        except (KeyError, OSError, ValueError):
            pass
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


def done() -> None:
    """Stop warming (the probes are in); the dummies close on the thread."""
    global _current
    w, _current = _current, None
    if w is not None:
        w.done()
