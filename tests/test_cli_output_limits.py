"""Output that says what it left out (issue 25 item 15): fire lines
rate-limited with a count of those not shown, -q quiet, `show RUN --limit`,
`faults` ending with how many more match, whole values off a terminal."""

from __future__ import annotations

import os
import pty
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gftarget import LIB, Target
from procio import finish, start_ready

from pyctl.cli.launch import FireLines

GF = [sys.executable, "-m", "pyctl"]
CALLS = 300  # every one fails: a burst of fire lines


def gf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GF, *args], capture_output=True, text=True, timeout=60)


def test_fire_lines_limited_and_every_one_counted() -> None:
    """The limiter alone, on a clock the test moves: a burst in full, then
    about PER_S a second, and each line held back is in a count line."""
    said: list[str] = []
    fl = FireLines(said.append, lambda: "run1")
    now = [0.0]
    fl._clock = lambda: now[0]  # type: ignore[method-assign]
    fl._last = fl._summary_at = 0.0
    row = {"fault_id": "run1-1", "function": "f", "pid": 1, "tid": 1, "comm": "c",
           "call_seq": 1, "action": "fail", "retval": -5, "mechanism": "bpf"}  # fmt: skip
    for i in range(1000):  # 1,000 fires in 10 s
        now[0] = i / 100
        fl.fire(row)
    fl.flush()
    shown = sum(1 for s in said if s.startswith("FAULT "))
    held = sum(int(m.group(1)) for s in said if (m := re.search(r"(\d+) more fire lines?", s)))
    assert shown + held == 1000
    assert shown <= FireLines.BURST + 10 * FireLines.PER_S + 1
    counts = [s for s in said if "not shown" in s]
    assert 5 <= len(counts) <= 11  # about once a second, and at the end
    assert all("gpufault faults --run run1" in s for s in counts)


def _burst_run(target: Target, db: Path, *extra: str) -> tuple[str, list[str]]:
    """An inject that fails every call while CALLS calls happen (from its
    --ready-fd line on: every probe live); its run id and its stderr lines."""
    ctl, run_id = start_ready(
        [*GF, "--db", str(db), "inject", "--pid", str(target.pid), "--lib", str(LIB),
         "--fn", "gf_victim", "--ret", "-5", *extra]
    )  # fmt: skip
    rows = target.victim(CALLS)
    assert sum(1 for r in rows if r[3] == -5) == CALLS
    ctl.send_signal(2)
    _, rest = finish(ctl, timeout=30)
    assert ctl.returncode == 0, rest
    return run_id, rest.splitlines(keepends=True)


@pytest.mark.root
def test_burst_of_fires_prints_a_few_lines_and_a_count(target: Target, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    run_id, lines = _burst_run(target, db)
    shown = [ln for ln in lines if ln.startswith("FAULT ")]
    held = sum(int(m.group(1)) for ln in lines if (m := re.search(r"(\d+) more fire lines?", ln)))
    assert len(shown) < CALLS / 4, len(shown)
    assert len(shown) + held == CALLS, "".join(lines)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(*) FROM faults").fetchone()[0] == CALLS


@pytest.mark.root
def test_quiet_prints_nothing_and_ready_fd_says_when_probes_are_live(
    target: Target, tmp_path: Path
) -> None:
    """-q is quiet: not a line on stderr for a run of CALLS fires (before:
    the start-up line, which tests waited for). What waits for the probes
    reads --ready-fd: `ready RUN` (the run the store holds), then end of
    file; the target's very next calls fail."""
    db = tmp_path / "gf.db"
    run_id, lines = _burst_run(target, db, "-q")
    assert lines == [], "".join(lines)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT run_id FROM runs").fetchall() == [(run_id,)]
    # Without -q the start-up line is still there, beside the ready line.
    run2, lines = _burst_run(target, db)
    assert f"[run {run2}, " in lines[0] and "Ctrl-C to end" in lines[0], "".join(lines)


@pytest.mark.root
def test_ready_fd_is_closed_without_a_line_when_the_run_does_not_start(
    tmp_path: Path,
) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    r, w = os.pipe()
    try:
        res = subprocess.run(
            [*GF, "--db", str(tmp_path / "gf.db"), "inject", "-q", "--pid", str(dead.pid),
             "--lib", str(LIB), "--fn", "gf_victim", "--ret", "-5", "--ready-fd", str(w)],
            capture_output=True, text=True, timeout=60, pass_fds=(w,),
        )  # fmt: skip
    finally:
        os.close(w)
    with os.fdopen(r) as f:
        said = f.read()  # end of file: the controller is gone, and said nothing
    assert said == "" and res.returncode == 2, (said, res)
    assert len(res.stderr.splitlines()) == 1 and "no process" in res.stderr, res.stderr


@pytest.mark.parametrize(
    "fd, why",
    [("2", "give a descriptor of 3 or more"), ("999", "descriptor 999 is not open"),
     ("x", "is not a valid integer")],
)  # fmt: skip
def test_a_ready_fd_that_cannot_be_is_one_line(tmp_path: Path, fd: str, why: str) -> None:
    db = tmp_path / "gf.db"
    res = gf("--db", str(db), "trace", "-q", "--pid", str(os.getpid()), "--lib", "libc",
             "--fn", "getpid", "--ready-fd", fd)  # fmt: skip
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 1 and why in lines[0], res.stderr
    assert lines[0].startswith("gpufault: ") and not db.exists()


@pytest.fixture(scope="module")
def many_faults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    t = Target()
    try:
        db = tmp_path_factory.mktemp("many") / "gf.db"
        run_id, _ = _burst_run(t, db, "-q")
        yield db, run_id
    finally:
        t.close()


@pytest.mark.root
def test_faults_says_how_many_more(many_faults: tuple[Path, str]) -> None:
    db, run_id = many_faults
    res = gf("--db", str(db), "faults", "--run", run_id, "--limit", "5")
    assert res.returncode == 0, res.stderr
    out = res.stdout.strip().splitlines()
    assert len(out) == 1 + 5 + 1, res.stdout  # header, rows, the count
    assert out[-1] == f"... {CALLS - 5} more (--limit {CALLS} lists them all)"
    # Everything shown: no count line.
    res = gf("--db", str(db), "faults", "--run", run_id, "--limit", str(CALLS))
    assert "more" not in res.stdout and len(res.stdout.strip().splitlines()) == 1 + CALLS
    res = gf("--db", str(db), "faults", "--limit", "0")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.root
def test_show_run_is_limited_and_says_so(many_faults: tuple[Path, str]) -> None:
    db, run_id = many_faults
    res = gf("--db", str(db), "show", run_id)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("\nfault ") + res.stdout.startswith("fault ") == 10
    assert f"... {CALLS - 10} more faults in run {run_id} (--limit {CALLS}" in res.stdout
    res = gf("--db", str(db), "show", run_id, "--limit", "2")
    assert res.stdout.count(f"fault {run_id}-") == 2 and f"{CALLS - 2} more" in res.stdout
    # --json: every fault unless --limit says otherwise.
    import json

    res = gf("--db", str(db), "show", run_id, "--json")
    assert len(json.loads(res.stdout)) == CALLS
    res = gf("--db", str(db), "show", run_id, "--json", "--limit", "3")
    assert len(json.loads(res.stdout)) == 3


def _on_a_terminal(*args: str) -> str:
    """stdout (and stderr) of gpufault ARGS on a pseudo-terminal."""
    main, sub = pty.openpty()
    try:
        p = subprocess.Popen([*GF, *args], stdout=sub, stderr=sub, stdin=subprocess.DEVNULL)
        os.close(sub)
        out = b""
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            out += chunk
        assert p.wait(timeout=60) == 0, out
        return out.decode()
    finally:
        os.close(main)


@pytest.mark.root
def test_full_values_off_a_terminal_ellipsis_on_one(many_faults: tuple[Path, str]) -> None:
    db, run_id = many_faults
    # libgftarget.so is 14 characters: the LIBRARY column is 12.
    piped = gf("--db", str(db), "faults", "--run", run_id, "--limit", "1").stdout
    assert " libgftarget.so " in piped and "\u2026" not in piped, piped
    tty = _on_a_terminal("--db", str(db), "faults", "--run", run_id, "--limit", "1")
    assert " libgftarget\u2026 " in tty, tty
