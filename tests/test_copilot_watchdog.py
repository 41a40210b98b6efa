"""The stall watchdog: a POSIX timer (SIGKILL) that the copilot keeps armed at
the latest planned stall end + WATCHDOG_GRACE_NS, so that a hung controller
is killed and the kernel resumes its stalled threads.

Unit tests (anyone): the timer itself, in throw-away child processes.
Root tests: a copilot in a child process stalls a real target's thread for
300 ms and then hangs (SIGSTOP, or a C call that holds the GIL); the
watchdog kills it, the thread resumes, nothing stays traced. And the other
way: a stall that ends on time disarms the timer, and the controller lives.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_copilot import (  # noqa: F401 (run, target_exe are fixtures)
    BODY_RET,
    TIMEOUT,
    PendingDouble,
    Run,
    Target,
    assert_target_carries_on,
    assert_untraced_and_running,
    run,
    target_exe,
)
from test_copilot import pytestmark as ROOT_MARKS

from pyctl.copilot import GF_ACT_STALL, Copilot, procfs
from pyctl.copilot.tracer import WATCHDOG_GRACE_NS
from pyctl.copilot.watchdog import FALLBACK_SIGNAL, Watchdog

REPO = Path(__file__).resolve().parent.parent
STALL_NS = 300_000_000
# How late (after its expiry) the watchdog may kill and the thread resume:
# the kernel's timer and the exit are quick, but this VM is shared and loaded.
MARGIN_NS = 1_000_000_000


def root(fn: Callable[..., Any]) -> Callable[..., Any]:
    for mark in reversed(ROOT_MARKS):
        fn = mark(fn)
    return fn


def proc_timers(pid: int | str = "self") -> list[dict[str, str]]:
    """/proc/PID/timers: one dict per POSIX timer (ID, signal, notify, ClockID)."""
    timers: list[dict[str, str]] = []
    with open(f"/proc/{pid}/timers") as f:
        for line in f:
            key, _, value = line.strip().partition(": ")
            if key == "ID":
                timers.append({})
            if key:
                timers[-1][key] = value
    return timers


def wait_exit(proc: subprocess.Popen[Any], timeout_s: float) -> int | None:
    """CLOCK_MONOTONIC ns at which proc exited (pidfd readable), None on timeout."""
    fd = os.pidfd_open(proc.pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(max(0, int(timeout_s * 1000))):
            return None
        return time.monotonic_ns()
    finally:
        os.close(fd)


def python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def read_line(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"child ended early ({proc.wait()})"
    return line.split()


# ---- the timer (no root) ----


def test_timer_is_sigkill_on_clock_monotonic_and_deleted_on_close() -> None:
    wd = Watchdog()
    try:
        # This kernel (6.18) accepts SIGKILL as sigev_signo: no fallback.
        assert wd.signo == signal.SIGKILL
        (mine,) = [t for t in proc_timers() if t["ID"] == str(wd.timer_id)]
        assert mine["signal"].split("/")[0] == "9"
        assert mine["ClockID"] == "1"  # CLOCK_MONOTONIC
        assert wd.remaining_ns() == 0 and wd.expiry_ns is None
        at = time.monotonic_ns() + 3600 * 10**9
        wd.arm(at)
        assert wd.expiry_ns == at
        assert 3500 * 10**9 < wd.remaining_ns() <= 3600 * 10**9
        wd.disarm()
        assert wd.remaining_ns() == 0 and wd.expiry_ns is None
    finally:
        wd.close()
    wd.close()  # idempotent
    assert str(wd.timer_id) not in [t["ID"] for t in proc_timers()]
    wd.arm(time.monotonic_ns())  # a closed watchdog arms nothing
    assert wd.remaining_ns() == 0


# A child that arms the watchdog 300 ms ahead, says so, then hangs.
HANG = """
    import ctypes, os, signal, sys, time
    from pyctl.copilot.watchdog import FALLBACK_SIGNAL, Watchdog
    how = sys.argv[1]
    wd = Watchdog(FALLBACK_SIGNAL if how == "fallback" else None)
    if os.fork() == 0:  # POSIX timers are not inherited across fork
        os._exit(0 if open("/proc/self/timers").read() == "" else 1)
    assert os.wait()[1] == 0
    at = time.monotonic_ns() + 300_000_000
    wd.arm(at)
    print("armed", at, wd.signo, flush=True)
    if how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        ctypes.PyDLL(None).pause()  # blocks in C with the GIL held
    print("survived", flush=True)
"""


@pytest.mark.parametrize("how", ["sigstop", "gil", "fallback"])
def test_timer_kills_a_hung_process(how: str) -> None:
    child = python(HANG, how)
    try:
        tag, at, signo = read_line(child)
        assert tag == "armed"
        died = wait_exit(child, TIMEOUT)
        assert died is not None, "the watchdog did not kill the hung child"
        assert child.wait() == -int(signo)
        assert int(signo) == (FALLBACK_SIGNAL if how == "fallback" else signal.SIGKILL)
        assert int(at) <= died < int(at) + MARGIN_NS
    finally:
        child.kill()
        child.wait()


def test_fallback_signal_with_a_handler_is_refused() -> None:
    old = signal.signal(FALLBACK_SIGNAL, lambda *_: None)
    try:
        with pytest.raises(OSError, match="has a handler"):
            Watchdog(FALLBACK_SIGNAL)
    finally:
        signal.signal(FALLBACK_SIGNAL, old)


# ---- the copilot's use of it (root, real ptrace) ----

# The controller: a copilot whose first injection is a 300 ms stall. It
# prints the stall and the watchdog's expiry, then hangs ("sigstop", "gil")
# or waits for the stall to end and reports the timer ("ends"), then stops
# itself so that only the timer could still kill it.
CONTROLLER = """
    import ctypes, os, signal, sys, threading
    from pyctl.copilot import GF_ACT_STALL, Copilot, Injection, ptrace
    pid, how, stall_ns = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    left = [1]
    ended = threading.Event()
    def fetch(tid):
        if not left[0]:
            return None
        try:
            regs = ptrace.getregs(tid)[:21]
        except OSError:
            return None
        left[0] -= 1
        return Injection(1, tuple(regs), 0, stall_ns, 0, GF_ACT_STALL, 0)
    cp = Copilot(pid, signal.SIGURG, fetch, lambda o: ended.set())
    cp.start()
    print("attached", cp.watchdog.signo, flush=True)
    tid = cp.wait_stalled(1)[0]
    print("stalled", tid, cp.watchdog_expiry_ns, cp.watchdog.remaining_ns(), flush=True)
    if how == "gil":
        ctypes.PyDLL(None).pause()  # blocks in C with the GIL held
    if how == "ends":
        ended.wait()
        print("ended", cp.watchdog_expiry_ns, cp.watchdog.remaining_ns(), flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
"""


@root
@pytest.mark.parametrize("how", ["sigstop", "gil"])
def test_hung_controller_is_killed_and_stalled_thread_resumes(
    target_exe: Path,  # noqa: F811
    how: str,
) -> None:
    t = Target(target_exe)
    child = python(CONTROLLER, str(t.pid), how, str(STALL_NS))
    try:
        assert read_line(child) == ["attached", str(int(signal.SIGKILL))]
        t.send("thread skip")
        tid = int(t.expect("begin")["tid"])
        tag, stalled, expiry_s, remaining = read_line(child)
        assert (tag, int(stalled)) == ("stalled", tid)
        expiry = int(expiry_s)
        planned_end = expiry - WATCHDOG_GRACE_NS  # the stall's own end
        assert 0 < int(remaining) <= WATCHDOG_GRACE_NS + STALL_NS
        assert [tm["signal"][:2] for tm in proc_timers(child.pid)] == ["9/"]
        assert procfs.thread_state(t.pid, tid) == "t"
        died = wait_exit(child, (expiry - time.monotonic_ns()) / 1e9 + TIMEOUT)
        assert died is not None, "the hung controller was not killed"
        assert child.wait() == -signal.SIGKILL
        end = t.expect("end")  # the stalled call returns, body run (signal ignored)
        assert (end["ret"], end["body"], end["tid"]) == (str(BODY_RET), "1", str(tid))
        resumed = int(end["at"])
        print(
            f"{how}: planned stall end -> controller killed {(died - planned_end) / 1e6:.1f} ms, "
            f"-> thread resumed {(resumed - planned_end) / 1e6:.1f} ms "
            f"(grace {WATCHDOG_GRACE_NS / 1e6:.0f} ms)"
        )
        assert expiry <= died < expiry + MARGIN_NS
        assert expiry <= resumed < expiry + MARGIN_NS
        assert_target_carries_on(t)
    finally:
        child.kill()
        child.wait()
        t.close()


@root
def test_stall_that_ends_on_time_disarms_and_controller_lives(
    target_exe: Path,  # noqa: F811
) -> None:
    t = Target(target_exe)
    child = python(CONTROLLER, str(t.pid), "ends", str(STALL_NS))
    try:
        read_line(child)
        t.send("thread skip")
        tid = int(t.expect("begin")["tid"])
        tag, _, expiry_s, _ = read_line(child)
        assert tag == "stalled"
        end = t.expect("end")
        assert end["tid"] == str(tid)
        # Ended by the copilot on time, so well before the watchdog's expiry.
        assert int(end["at"]) < int(expiry_s) - WATCHDOG_GRACE_NS // 2
        # The kernel's timer is disarmed (timer_gettime), not just our copy.
        assert read_line(child) == ["ended", "None", "0"]
        # The controller now stops itself while traced: only an armed timer
        # could kill it. Nothing does by the former expiry + margin.
        assert wait_exit(child, (int(expiry_s) + MARGIN_NS - time.monotonic_ns()) / 1e9) is None
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
        t.close()


@root
def test_indefinite_stall_arms_nothing(run: Callable[..., Run]) -> None:  # noqa: F811
    r = run(PendingDouble(action=GF_ACT_STALL, stall_ns=0, deadline_ns=0))
    assert r.copilot.watchdog is not None
    r.double.arm(1)
    r.target.send("thread skip")
    assert len(r.copilot.wait_stalled(1, timeout=TIMEOUT)) == 1
    assert r.copilot.watchdog_expiry_ns is None
    assert r.copilot.watchdog.remaining_ns() == 0
    assert r.copilot.release() == 1
    assert r.target.expect("end")["ret"] == str(BODY_RET)


@root
def test_expiry_follows_the_latest_stall_end(run: Callable[..., Run]) -> None:  # noqa: F811
    double = PendingDouble(action=GF_ACT_STALL, stall_ns=0)
    r = run(double)
    wd = r.copilot.watchdog
    assert wd is not None and r.copilot.watchdog_expiry_ns is None
    ends = []
    for i, later_s in enumerate((30, 60)):  # far enough that only release() ends them
        double.deadline_ns = time.monotonic_ns() + later_s * 10**9
        ends.append(double.deadline_ns)
        double.arm(1)
        r.target.send("thread skip")
        tids = r.copilot.wait_stalled(i + 1, timeout=TIMEOUT)
        assert len(tids) == i + 1
        assert r.copilot.watchdog_expiry_ns == double.deadline_ns + WATCHDOG_GRACE_NS
    first = int(r.target.expect("begin")["tid"])
    second = int(r.target.expect("begin")["tid"])
    # The later stall ends first: the timer moves back to the earlier end.
    assert r.copilot.release(second) == 1
    assert r.copilot.watchdog_expiry_ns == ends[0] + WATCHDOG_GRACE_NS
    left = wd.remaining_ns()
    assert 0 < left <= ends[0] + WATCHDOG_GRACE_NS - time.monotonic_ns() + 10**9
    assert r.copilot.release(first) == 1
    assert r.copilot.watchdog_expiry_ns is None and wd.remaining_ns() == 0
    timer = str(wd.timer_id)
    assert timer in [t["ID"] for t in proc_timers()]
    r.copilot.stop()
    assert wd.closed and timer not in [t["ID"] for t in proc_timers()]


@root
def test_watchdog_can_be_turned_off(target_exe: Path) -> None:  # noqa: F811
    double = PendingDouble(action=GF_ACT_STALL, stall_ns=STALL_NS)
    t = Target(target_exe)
    cp = Copilot(t.pid, signal.SIGURG, double.fetch, watchdog_grace_ns=None)
    try:
        cp.start()
        assert cp.watchdog is None
        double.arm(1)
        assert t.ask("skip")["ret"] == str(BODY_RET)
        assert cp.watchdog_expiry_ns is None
    finally:
        cp.stop()
        t.close()
