"""pyctl/heldcalls.py and pyctl/bpf/raw.py's held lookup: the copilot's
system calls that keep the GIL (issue 26), against the os module's and
the kernel's own answers; the switch interval while copilots run, nested
and restored."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import pytest
from conftest import requires_root

from pyctl import heldcalls
from pyctl.bpf import libbpf, raw
from pyctl.copilot import ptrace

FUNCFLAG_PYTHONAPI = 4  # ctypes: a PyDLL function, called with the GIL held


def test_every_call_is_made_with_the_gil_held() -> None:
    # A CDLL function releases the GIL: the flag is what PyDLL adds.
    for fn in (heldcalls.ptrace, heldcalls._waitpid, heldcalls._pread, raw._held.syscall):
        assert fn._flags_ & FUNCFLAG_PYTHONAPI, fn
    assert ptrace._ptrace is heldcalls.ptrace


def test_gil_held_means_no_other_thread_runs_python_meanwhile() -> None:
    """A C call that keeps the GIL lets no Python thread in during it; the
    same call through CDLL does (the ticker counts while it sleeps). The
    ticker may run for one switch interval (5 ms) between reading the count
    and the call: against the 200 ms of the call, a small share."""
    ticks = [0]
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks[0] += 1

    held = ctypes.PyDLL(None).usleep
    free = ctypes.CDLL(None).usleep
    t = threading.Thread(target=ticker)
    t.start()
    try:
        seen = {}
        for name, fn in (("held", held), ("free", free)):
            before = ticks[0]
            fn(200_000)
            seen[name] = ticks[0] - before
    finally:
        stop.set()
        t.join()
    assert seen["held"] * 5 < seen["free"], seen


def test_pread_reads_what_os_pread_reads() -> None:
    data = ctypes.create_string_buffer(b"gpufault heldcalls " * 300)
    addr = ctypes.addressof(data)
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        for n in (8, 200, 4096, 5000):
            assert heldcalls.pread(fd, n, addr) == os.pread(fd, n, addr)
        with pytest.raises(OSError):
            heldcalls.pread(fd, 8, 8)  # not mapped: EIO, raised
    finally:
        os.close(fd)


def test_waitpid_is_nonblocking_and_says_echild() -> None:
    with pytest.raises(ValueError):
        heldcalls.waitpid(-1, 0)  # would block
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-I", "-c", "import os; os.read(0, 1)"], stdin=r)
    os.close(r)
    try:
        assert heldcalls.waitpid(p.pid, os.WNOHANG) == (0, 0)
    finally:
        os.close(w)  # EOF: it exits
    got = (0, 0)
    while got[0] == 0:
        got = heldcalls.waitpid(p.pid, os.WNOHANG)
        if got[0] == 0:
            os.sched_yield()
    assert got[0] == p.pid and os.WIFEXITED(got[1]) and os.WEXITSTATUS(got[1]) == 0
    p.returncode = 0  # reaped here
    with pytest.raises(ChildProcessError):
        heldcalls.waitpid(p.pid, os.WNOHANG)


@requires_root
def test_map_lookup_and_delete_as_libbpf_does() -> None:
    lb = libbpf.lib()
    lb.bpf_map_create.restype = ctypes.c_int
    lb.bpf_map_create.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32,
                                  ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p]  # fmt: skip
    fd = lb.bpf_map_create(1, b"gf_heldtest", 4, 8, 16, None)  # BPF_MAP_TYPE_HASH
    assert fd >= 0, ctypes.get_errno()
    try:
        libbpf.map_update(fd, ctypes.c_uint32(7), ctypes.c_uint64(0xFEEDFACE))
        out = ctypes.c_uint64(0)
        assert raw.map_lookup_and_delete_held(fd, ctypes.c_uint32(7), out)
        assert out.value == 0xFEEDFACE
        assert not raw.map_lookup_and_delete_held(fd, ctypes.c_uint32(7), out)  # deleted
    finally:
        os.close(fd)


def test_fast_switch_nests_and_restores() -> None:
    old = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        heldcalls.fast_switch_begin()
        heldcalls.fast_switch_begin()
        assert sys.getswitchinterval() == pytest.approx(heldcalls.FAST_SWITCH_S)
        heldcalls.fast_switch_end()
        assert sys.getswitchinterval() == pytest.approx(heldcalls.FAST_SWITCH_S)
        heldcalls.fast_switch_end()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        heldcalls.fast_switch_end()  # one too many: nothing
        assert sys.getswitchinterval() == pytest.approx(0.005)
        # A harness that set its own interval meanwhile keeps it.
        heldcalls.fast_switch_begin()
        sys.setswitchinterval(0.002)
        heldcalls.fast_switch_end()
        assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(old)
