"""Targets whose /proc/PID says zombie: a process whose main thread called
pthread_exit while its workers run (alive: probe it), and a real zombie,
exited and not reaped (nothing runs: refuse it, never wait on it)."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gftarget import LIB, REPO, bpf_progs, no_new_progs

GF = [sys.executable, "-m", "pyctl"]
MAINEXIT = REPO / "build" / "targets" / "gf_mainexit"

pytestmark = pytest.mark.root


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _await_state(pid: int, want: str, timeout: float = 10.0) -> None:
    """The kernel marks the exited leader Z just after pthread_join returns
    in the target: await that state, do not assume it."""
    deadline = time.monotonic() + timeout
    while _state(pid) != want:
        assert time.monotonic() < deadline, f"pid {pid} never reached state {want}"
        time.sleep(0.01)


class MainExited:
    """build/targets/gf_mainexit: main has exited, one worker calls gf_victim."""

    def __init__(self) -> None:
        self.p = subprocess.Popen(
            [str(MAINEXIT), "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.p.stdout is not None
        assert self.p.stdout.readline().startswith("ready")
        self.pid = self.p.pid
        _await_state(self.pid, "Z")

    def count(self) -> tuple[int, int]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write("count\n")
        self.p.stdin.flush()
        words = dict(w.split("=") for w in self.p.stdout.readline().split()[1:])
        return int(words["calls"]), int(words["failed"])

    def close(self) -> None:
        if self.p.poll() is None:
            assert self.p.stdin is not None
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
        self.p.wait(timeout=10)


@pytest.fixture
def mainexit() -> Iterator[MainExited]:
    t = MainExited()
    yield t
    t.close()


def _runs(db: Path) -> list[tuple[str, str, str]]:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT run_id, status, stats FROM runs").fetchall()


def test_trace_counts_calls_of_threads_whose_main_exited(
    mainexit: MainExited, tmp_path: Path
) -> None:
    db = tmp_path / "gf.db"
    res = subprocess.run(
        [*GF, "--db", str(db), "trace", "--pid", str(mainexit.pid), "--lib", "libgftarget",
         "--fn", "gf_victim", "--duration", "1s", "--max-db-size", "16M", "--no-summary"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "main thread has exited" in res.stderr  # the note: probes go on the file
    with sqlite3.connect(db) as c:
        (calls,) = c.execute("SELECT json_extract(stats, '$.calls') FROM runs").fetchone()
        (rows,) = c.execute("SELECT count(*) FROM calls").fetchone()
    # The worker calls ~1M/s without probes: a trace that missed them saw 0.
    assert calls > 1000 and rows > 0, res.stderr


def test_inject_fires_in_threads_whose_main_exited(mainexit: MainExited, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    _, failed_before = mainexit.count()
    res = subprocess.run(
        [*GF, "--db", str(db), "inject", "--pid", str(mainexit.pid), "--lib", str(LIB),
         "--fn", "gf_victim", "--ret", "-5", "--every", "50000", "--duration", "2s", "-q"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    _, failed = mainexit.count()
    ((run_id, status, _),) = _runs(db)
    with sqlite3.connect(db) as c:
        (stored,) = c.execute("SELECT count(*) FROM faults WHERE run_id=?", (run_id,)).fetchone()
    assert status == "done"
    # Every failure the target saw is a stored fault, and there were some.
    assert stored > 0 and failed - failed_before == stored, (stored, failed, res.stderr)


@pytest.mark.parametrize("cmd", ["trace", "inject"])
def test_real_zombie_refused_with_one_line(cmd: str, tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])  # not waited for: a zombie until reaped
    try:
        _await_state(child.pid, "Z")
        db = tmp_path / "gf.db"
        before = bpf_progs()
        extra = ["--ret", "-1"] if cmd == "inject" else []
        t0 = time.monotonic()
        res = subprocess.run(
            [*GF, "--db", str(db), cmd, "--pid", str(child.pid), "--lib", "libc",
             "--fn", "getpid", *extra],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        # Refused at once: without --duration, an accepted zombie never ended.
        assert time.monotonic() - t0 < 30
        assert res.returncode == 2, res
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "zombie" in lines[0] and lines[0].startswith("gpufault: ")
        assert not db.exists()
        assert no_new_progs(before)
    finally:
        child.wait()


def test_a_target_that_becomes_a_zombie_ends_the_run(tmp_path: Path) -> None:
    """The loop's exit check is "no live thread", not "/proc/PID is gone": a
    target whose parent (here: this test) has not reaped it ends the run."""
    from gftarget import Target

    t = Target()
    db = tmp_path / "gf.db"
    from procio import start_controller

    ctl, _ = start_controller(
        [*GF, "--db", str(db), "trace", "--pid", str(t.pid), "--lib", str(LIB),
         "--fn", "gf_victim", "--no-summary"]
    )  # fmt: skip
    try:
        assert t.p.stdin is not None
        t.p.stdin.write("quit\n")
        t.p.stdin.flush()
        _await_state(t.pid, "Z")  # exited; Popen has not reaped it
        assert ctl.wait(timeout=20) == 0
        ((_, status, _),) = _runs(db)
        assert status == "done"
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
        t.p.wait(timeout=10)


def test_calls_live_counts_threads_whose_main_exited(mainexit: MainExited) -> None:
    """`calls live` attaches its own programs: the same pid filter, the same fix."""
    res = subprocess.run(
        [*GF, "calls", "live", "--pid", str(mainexit.pid), "--lib", "libgftarget",
         "--fn", "gf_victim", "--duration", "1s", "--count-only"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    m = re.search(r"^([\d,]+) calls to 1 function", res.stdout, re.M)
    assert m and int(m.group(1).replace(",", "")) > 1000, res.stdout
