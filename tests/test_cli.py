"""The gpufault CLI as a user runs it: real processes, real exit codes."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from gftarget import LIB, Target, bpf_progs, no_new_progs
from procio import start_controller

from pyctl.cli import cli

GF = [sys.executable, "-m", "pyctl"]


def test_every_command_has_help() -> None:
    runner = CliRunner()

    def walk(group: click.Group, prefix: list[str]) -> None:
        for name, cmd in group.commands.items():
            res = runner.invoke(cli, [*prefix, name, "--help"])
            assert res.exit_code == 0, (name, res.output)
            assert cmd.help and cmd.help.strip(), f"{name} has no help text"
            if isinstance(cmd, click.Group):
                walk(cmd, [*prefix, name])

    walk(cli, [])


def gf(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GF, *args], capture_output=True, text=True, timeout=60, **kw)


def armed_controller(pid: int, *args: str) -> subprocess.Popen[str]:
    """`gpufault inject --pid PID --lib LIB --fn gf_victim ARGS`, returned
    once armed (it prints its start-up line only after attaching)."""
    ctl, _ = start_controller(
        [*GF, "inject", "--pid", str(pid), "--lib", str(LIB), "--fn", "gf_victim", *args]
    )
    return ctl


@pytest.mark.root
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--lib", "libnosuchlib", "--fn", "x"], "library 'libnosuchlib' not found"),
        (["--lib", str(LIB), "--fn", "no_such_fn"], "symbol 'no_such_fn' not found"),
        (["--lib", str(LIB), "--fn", "gf_victim", "--nth", "3x"], "--nth: '3x' is not a number"),
        (["--lib", str(LIB), "--fn", "gf_victim", "--prob", "200%"], "--prob"),
        (["--lib", str(LIB), "--fn", "gf_victim", "--ret", "CUDA_ERROR_NOPE"], "--ret"),
        (["--lib", str(LIB), "--fn", "gf_victim", "--when", "arg9>1"], "--when"),
        (["--lib", str(LIB), "--fn", "gf_victim", "--action", "signal"], "--signal"),
        (["--lib", str(LIB), "--fn", "gf_victim", "--action", "corrupt"], "--corrupt"),
    ],
    ids=["lib", "symbol", "number", "prob", "ret", "predicate", "signal", "corrupt"],
)
def test_bad_input_one_line_exit_2_nothing_left(
    target: Target, tmp_path: Path, args, needle
) -> None:
    db = tmp_path / "gf.db"
    before = bpf_progs()
    res = (
        gf("inject", "--pid", str(target.pid), "--ret", "1", *args, "--db", str(db))
        if "--ret" not in args
        else gf("inject", "--pid", str(target.pid), *args, "--db", str(db))
    )
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert not db.exists()
    assert no_new_progs(before)
    # The target is untouched.
    assert [r[3] for r in target.victim(3)] == [2, 3, 4]


@pytest.mark.root
def test_dead_pid(tmp_path: Path) -> None:
    res = gf(
        "trace",
        "--pid",
        str(2**22 + 11),
        "--lib",
        "libc",
        "--fn",
        "getpid",
        "--db",
        str(tmp_path / "gf.db"),
    )
    assert res.returncode == 2 and "no process" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.root
def test_fail_needs_a_target(tmp_path: Path) -> None:
    res = gf(
        "inject",
        "--lib",
        str(LIB),
        "--fn",
        "gf_victim",
        "--ret",
        "1",
        "--db",
        str(tmp_path / "gf.db"),
    )
    assert res.returncode == 2 and "give a target" in res.stderr


def test_not_root_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real unprivileged interpreter cannot even import our dependencies
    # from root's site-packages here, so pretend in-process instead.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    db = tmp_path / "gf.db"
    res = CliRunner().invoke(
        cli,
        [
            "inject",
            "--pid",
            str(os.getpid()),
            "--lib",
            "libc",
            "--fn",
            "getpid",
            "--ret",
            "1",
            "--db",
            str(db),
        ],
    )
    assert res.exit_code == 2
    assert "needs root" in res.output and len(res.output.strip().splitlines()) == 1
    assert not db.exists()


@pytest.mark.root
def test_command_exit_status_is_passed_on(tmp_path: Path) -> None:
    from gftarget import TARGET

    res = gf(
        "inject",
        "-q",
        "--lib",
        str(LIB),
        "--fn",
        "gf_alloc",
        "--action",
        "signal",
        "--signal",
        "SIGSEGV",
        "--nth",
        "2",
        "--db",
        str(tmp_path / "gf.db"),
        "--",
        str(TARGET),
        input="alloc 3\nquit\n",
    )
    assert res.returncode == 128 + signal.SIGSEGV, res
    res2 = gf("faults", "--json", "--db", str(tmp_path / "gf.db"))
    rows = json.loads(res2.stdout)
    assert len(rows) == 1 and rows[0]["function"] == "gf_alloc" and rows[0]["links"] >= 1
    doc = json.loads(
        gf("show", rows[0]["fault_id"], "--json", "--db", str(tmp_path / "gf.db")).stdout
    )
    assert {"fault", "registers", "args", "stack", "links"} <= set(doc)
    assert [link["kind"] for link in doc["links"]][:1] == ["signal"]


@pytest.mark.root
def test_sigkill_of_controller_leaves_nothing(target: Target, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    before = bpf_progs()
    ctl = armed_controller(
        target.pid,
        "--action",
        "fail",
        "--ret",
        "-7",
        "--nth",
        "2",
        "--sticky",
        "--trace",
        "--db",
        str(db),
    )
    rows = target.victim(4)
    assert [r[3] for r in rows] == [2, -7, -7, -7]
    # Wait until the controller has committed the fault row.
    deadline = time.monotonic() + 20
    committed = 0
    while time.monotonic() < deadline and committed < 3:
        try:
            committed = sqlite3.connect(db).execute("SELECT count(*) FROM faults").fetchone()[0]
        except sqlite3.Error:
            committed = 0
    assert committed >= 3
    ctl.kill()
    ctl.wait(timeout=10)
    # No probe left, calls run normally, target alive.
    assert no_new_progs(before)
    assert [r[3] for r in target.victim(4)] == [2, 3, 4, 5]
    assert target.p.poll() is None
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert con.execute("SELECT count(*) FROM faults").fetchone()[0] >= committed
    assert oct(db.stat().st_mode & 0o777) == "0o600"


def _stopped_threads(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state in ("t", "T"):
            out.append(int(task.name))
    return out


@pytest.mark.root
def test_sigkill_while_a_thread_hangs(target: Target, tmp_path: Path) -> None:
    import threading

    ctl = armed_controller(
        target.pid, "--action", "stall", "--nth", "1", "--db", str(tmp_path / "gf.db")
    )
    result: list = []
    th = threading.Thread(target=lambda: result.append(target.victim(2)))
    th.start()
    # Await the hang: the calling thread sits in a ptrace stop.
    deadline = time.monotonic() + 20
    while not _stopped_threads(target.pid):
        assert time.monotonic() < deadline, "no thread was stalled"
    assert th.is_alive()
    ctl.kill()
    ctl.wait(timeout=10)
    th.join(timeout=20)
    assert not th.is_alive(), "the stalled thread never resumed"
    assert [r[3] for r in result[0]] == [2, 3]  # the call then ran normally
    assert target.p.poll() is None and not _stopped_threads(target.pid)
