"""`gpufault evidence pull` (issue 28): each agent's store, a consistent
snapshot over its authenticated link, merged into one local store. Two
real agents on Unix sockets, each arming a real fault in a gf_target; a
run still armed is left out and comes with the next pull; a snapshot
that does not match the agent's size and sha256 is refused and removed
(a fake root listener sends a damaged chunk); bad input is one line."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import threading
from pathlib import Path

import pytest
from agentproc import AgentProc
from conftest import requires_root
from gftarget import LIB, Target

import gpufault
from gpufault import Fault
from pyctl.agent import protocol
from pyctl.paths import module_argv

pytestmark = requires_root
VICTIM = (str(LIB), "gf_victim")


def _pull(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(module_argv("pyctl", ["evidence", "pull", *args]), cwd="/",
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def _faults(db: Path, run_id: str) -> int:
    c = sqlite3.connect(db)
    try:
        return int(c.execute("SELECT count(*) FROM faults WHERE run_id=?", (run_id,)).fetchone()[0])
    finally:
        c.close()


@pytest.fixture
def two_agents(tmp_path: Path):  # noqa: ANN201
    agents = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir(mode=0o700)
        agents.append(AgentProc(["--listen", f"unix:{tmp_path}/{name}/run/agent.sock",
                                 "--db", str(tmp_path / name / "gf.db")]))  # fmt: skip
    yield [(a, a.urls[0], tmp_path / n / "gf.db") for a, n in zip(agents, "ab", strict=True)]
    for a in agents:
        assert a.stop() == 0, a.lines


def test_two_agents_pulled_into_one_store_and_a_running_run_waits(
    two_agents: list[tuple[AgentProc, str, Path]], target: Target, tmp_path: Path
) -> None:
    (_, url_a, db_a), (_, url_b, db_b) = two_agents
    runs = []
    for url, n in ((url_a, 3), (url_b, 2)):
        with gpufault.AgentClient.connect(url) as c:
            h = c.arm(Fault.fail(*VICTIM, ret=-5, sticky=True, max_fires=n), target.pid,
                      lease_s=5, duration=60)  # fmt: skip
            target.victim(n)
            assert h.wait_fires(n, timeout=10)
            h.disarm()
            runs.append(h.run_id)
    # A third fault stays armed on agent b while it is pulled.
    c = gpufault.AgentClient.connect(url_b)
    live = c.arm(Fault.observe(*VICTIM), target.pid, lease_s=5, duration=60)
    try:
        into = tmp_path / "fleet.db"
        r = _pull(url_a, url_b, "--into", str(into))
        assert r.returncode == 0, r.stderr
        la, lb = r.stdout.splitlines()
        assert la.startswith(f"{url_a} (") and "1 runs, 3 faults" in la, la
        assert "sha256 " in la and "KiB" in la
        assert "1 runs, 1 still running (left out" in lb and "2 faults" in lb, lb
        assert [_faults(into, rid) for rid in runs] == [3, 2]
        assert [_faults(into, rid) for rid in runs] == [_faults(db_a, runs[0]),
                                                       _faults(db_b, runs[1])]  # fmt: skip
        assert _faults(into, live.run_id) == 0
        show = subprocess.run(module_argv("pyctl", ["show", f"{runs[1]}-1", "--db", str(into)]),
                              capture_output=True, text=True, timeout=60, cwd="/")  # fmt: skip
        assert show.returncode == 0 and "gf_victim" in show.stdout, show.stderr
    finally:
        live.disarm()
        c.close()
    again = _pull(url_a, url_b, "--into", str(into))
    assert again.returncode == 0, again.stderr
    la, lb = again.stdout.splitlines()
    assert "0 runs, 1 already there" in la, la  # nothing twice
    assert "1 runs, 1 already there" in lb, lb  # the run that ended comes now
    d = sqlite3.connect(into)
    assert d.execute("SELECT status FROM runs WHERE run_id=?", (live.run_id,)).fetchone() == (
        "done",
    )
    assert os.stat(into).st_mode & 0o077 == 0
    assert not [p for p in os.listdir("/var/tmp") if p.startswith("gf-pull-")]


def test_a_snapshot_that_does_not_match_is_refused_and_removed(tmp_path: Path) -> None:
    """A root listener (the client talks to no other) that answers a pull
    with a chunk whose bytes are not what its sha256 says."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(run / "agent.sock"))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        f = conn.makefile("rb")
        hello = protocol.decode(f.readline())
        conn.sendall(protocol.encode("ok", hello.id, agent="fake", auth="unix"))
        pull = protocol.decode(f.readline())
        conn.sendall(protocol.encode("data", pull=pull.id, seq=0, b64="AAAA"))
        conn.sendall(protocol.encode("ok", pull.id, bytes=3, sha256="0" * 64, runs=0, running=0))
        f.readline()  # the client's close
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    out = tmp_path / "snap.db"
    with gpufault.AgentClient.connect(f"unix:{run}/agent.sock") as c:
        with pytest.raises(gpufault.AgentError, match="got 3 bytes, sha256 .* pull again"):
            c.pull_evidence(out)
    assert not out.exists()
    srv.close()


def test_bad_pulls_are_one_line_and_leave_nothing(tmp_path: Path) -> None:
    into = tmp_path / "fleet.db"
    r = _pull("--into", str(into))
    assert r.returncode == 2 and "give the agents to pull from" in r.stderr, r.stderr
    r = _pull(f"unix:{tmp_path}/nobody/agent.sock", "--into", str(into))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not into.exists()
    assert not [p for p in os.listdir("/var/tmp") if p.startswith("gf-pull-")]


def test_an_agent_with_no_store_yet_says_so(tmp_path: Path) -> None:
    a = AgentProc(["--listen", f"unix:{tmp_path}/run/agent.sock", "--db", str(tmp_path / "g.db")])
    try:
        r = _pull(a.urls[0], "--into", str(tmp_path / "fleet.db"))
        assert r.returncode == 2 and "no evidence yet" in r.stderr, r.stderr
        assert json.loads("[]") == [] and not (tmp_path / "fleet.db").exists()
    finally:
        assert a.stop() == 0
