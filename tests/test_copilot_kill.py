"""SIGKILL of the copilot (run in a child process) while a thread is stalled
and while a fail is in flight: the kernel detaches, the pending signal is
delivered and ignored, the target runs on with no thread left stopped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_copilot import (  # noqa: F401 (target_exe is a fixture)
    BODY_RET,
    Target,
    assert_target_carries_on,
    assert_untraced_and_running,
    pytestmark,
    target_exe,
)

from pyctl.copilot import procfs

# The copilot child: "stall" hangs the first signalled thread; "inflight"
# blocks inside fetch, so it dies between the stop and the resume.
CHILD = r"""
import signal, sys, threading
from pyctl.copilot import GF_ACT_STALL, Copilot, Injection, ptrace
pid, mode = int(sys.argv[1]), sys.argv[2]
def fetch(tid):
    try:
        regs = ptrace.getregs(tid)[:21]
    except OSError:
        return None
    if mode == "stall":
        return Injection(1, tuple(regs), 0, 0, 0, GF_ACT_STALL, 0)
    print("inflight", tid, flush=True)
    threading.Event().wait()
cp = Copilot(pid, signal.SIGURG, fetch)
cp.start()
print("attached", flush=True)
if mode == "stall":
    print("stalled", cp.wait_stalled(1)[0], flush=True)
threading.Event().wait()
"""


@pytest.mark.parametrize("mode", ["stall", "inflight"])
def test_sigkill_of_copilot_leaves_target_running(target_exe: Path, mode: str) -> None:  # noqa: F811
    t = Target(target_exe)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(t.pid), mode], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "attached"
        t.ask("workers 2", "workers")
        t.send("thread skip")
        tid = int(t.expect("begin")["tid"])
        assert child.stdout.readline().split() == ["stalled" if mode == "stall" else mode, str(tid)]
        assert procfs.thread_state(t.pid, tid) == "t"
        child.kill()
        child.wait()
        # The held call completes normally: the signal was delivered and ignored.
        got = t.expect("end")
        assert (got["ret"], got["body"], got["regs"]) == (str(BODY_RET), "1", "1")
        assert_target_carries_on(t)
    finally:
        child.kill()
        child.wait()
        t.close()
