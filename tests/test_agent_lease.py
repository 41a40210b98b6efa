"""The agent's dead-man lease, on real processes: a controller SIGKILLed
while its fault fires in a running workload (the fault stops within the
lease plus the disarm, measured from the evidence's fire times), and the
agent itself SIGKILLed (its child controller disarms; the fault's own
deadline is the backstop)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agentproc import AgentProc, probed
from conftest import requires_root
from gftarget import LIB, Target

import gpufault
from gpufault import Fault

REPO = Path(__file__).resolve().parent.parent
EMPTY = (str(LIB), "gf_empty")
VICTIM = (str(LIB), "gf_victim")
LEASE_S = 1.0
# The lease's goal (expiry to the last fire within 0.1 s) is measured by
# bench/bench_agent.py; here a bound far below the fault's 60 s duration
# tells "ended by the lease" from "ended by its deadline" on a loaded host.
SLACK_S = 1.0

pytestmark = requires_root


@pytest.fixture
def agent(tmp_path: Path):  # noqa: ANN201
    a = AgentProc(["--listen", f"unix:{tmp_path}/run/agent.sock", "--db", str(tmp_path / "gf.db")])
    yield a
    if a.p.poll() is None:
        assert a.stop() == 0, a.lines


def _run_row(db: Path, run_id: str) -> tuple[str, dict]:
    d = sqlite3.connect(db)
    try:
        status, stats = d.execute("SELECT status, stats FROM runs WHERE run_id = ?",
                                  (run_id,)).fetchone()  # fmt: skip
        return status, json.loads(stats or "{}")
    finally:
        d.close()


def _fire_walls(db: Path, run_id: str) -> list[float]:
    d = sqlite3.connect(db)
    try:
        return [r[0] for r in d.execute("SELECT wall FROM faults WHERE run_id = ? ORDER BY wall",
                                        (run_id,))]  # fmt: skip
    finally:
        d.close()


def test_a_sigkilled_controllers_fault_stops_within_the_lease(
    agent: AgentProc, target: Target, tmp_path: Path
) -> None:
    url = agent.urls[0]
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
        "import gpufault\n"
        f"c = gpufault.AgentClient.connect({url!r})\n"
        f"h = c.arm(gpufault.Fault.fail({EMPTY[0]!r}, 'gf_empty', ret=-5, sticky=True, "
        f"stack=False), {target.pid}, lease_s={LEASE_S}, duration=60)\n"
        "print(h.run_id, flush=True)\n"
        "sys.stdin.read()\n"
    )
    ctl = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, cwd="/")  # fmt: skip
    assert ctl.stdout is not None
    run_id = ctl.stdout.readline().strip()
    assert run_id, "the controller did not arm"
    # The workload: gf_empty 400 times a second for 4 s, every call failed while armed.
    assert target.p.stdin is not None
    target.p.stdin.write("pace 1600 400\n")
    target.p.stdin.flush()
    with gpufault.AgentClient.connect(url) as watcher:
        deadline = time.monotonic() + 10
        while not (s := watcher.sessions()) or s[0]["renewals"] < 3:  # renewed, firing
            assert time.monotonic() < deadline, s
            time.sleep(0.05)  # the agent's state, no event to await from here
        killed = time.time()
        ctl.kill()
        ctl.wait()
        t0 = time.monotonic()
        while watcher.sessions():
            assert time.monotonic() - t0 < LEASE_S + 5, "not disarmed after the lease"
            time.sleep(0.01)
    out = [ln for ln in iter(target.p.stdout.readline, "done\n")]  # type: ignore[union-attr]
    assert out and out[0].startswith("ns_per_call="), out  # the workload ran to its end
    status, stats = _run_row(tmp_path / "gf.db", run_id)
    why = stats["agent"]
    assert status == "done" and why["ended_by"] == "lease-expired"
    walls = _fire_walls(tmp_path / "gf.db", run_id)
    expired, last = why["lease_expired_at"], walls[-1]
    print(f"kill->expiry {expired - killed:.3f}s, expiry->last fire {last - expired:.3f}s, "
          f"kill->last fire {last - killed:.3f}s, fires after kill "
          f"{sum(w > killed for w in walls)}")  # fmt: skip
    assert expired - killed <= LEASE_S + SLACK_S  # the lease ran from the last renewal
    assert sum(w > killed + 0.2 for w in walls) > 0  # the fault was live until the lease
    assert last - killed <= LEASE_S + 2 * SLACK_S
    assert [r[3] for r in target.victim(2)] == [2, 3] and not probed(target.pid, *EMPTY)


def test_a_sigkilled_agents_fault_ends_by_its_deadline(
    agent: AgentProc, target: Target, tmp_path: Path
) -> None:
    duration = 4.0
    c = gpufault.AgentClient.connect(agent.urls[0])
    h = c.arm(Fault.fail(*VICTIM, ret=-5, sticky=True), target.pid, lease_s=60,
              duration=duration)  # fmt: skip
    armed = time.monotonic()
    assert [r[3] for r in target.victim(1)] == [-5]
    os.kill(agent.pid, signal.SIGKILL)
    agent.p.wait()
    killed = time.monotonic()
    while probed(target.pid, *VICTIM):
        assert time.monotonic() - armed < duration + 1, "probes outlived the deadline"
        time.sleep(0.02)  # the target's own code bytes: nothing to await
    gone = time.monotonic()
    print(f"agent SIGKILL -> probes gone {gone - killed:.3f}s (deadline {duration:g}s)")
    assert [r[3] for r in target.victim(2)] == [2, 3]  # the target runs on, unfaulted
    c.close(disarm=False)
    d = sqlite3.connect(tmp_path / "gf.db")
    deadline = time.monotonic() + 10
    while d.execute("SELECT status FROM runs WHERE run_id=?", (h.run_id,)).fetchone()[0] != "done":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    d.close()
