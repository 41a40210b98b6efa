"""Evidence that never lies and a controller that always stops.

Real targets (build/targets/gf_target), real BPF, the CLI as a user runs
it; what the target saw is compared with the rows. Tests that need a full
or read-only filesystem mount a tmpfs inside their own private mount
namespace (`unshare -m`), so nothing stays mounted on the host.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gftarget import LIB, REPO, TARGET, Target, bpf_progs, no_new_progs, on_victim
from procio import finish, start_ready

from pyctl.engine import Engine
from pyctl.evidence import query, store
from pyctl.spec import FaultSpec

pytestmark = [pytest.mark.root]

if not TARGET.exists():  # pragma: no cover - the Makefile builds it first
    pytest.skip("build/targets/gf_target missing: run make build", allow_module_level=True)

GF = [sys.executable, "-m", "pyctl"]
# From the start-up line to the exit: the final drain (one 8 MiB ring at
# most), detaching and interpreter exit. Before the fix these runs never
# ended at this call rate.
SLACK_S = 5.0


def gf(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GF, *args], capture_output=True, text=True, timeout=90, cwd=REPO, **kw)


def q(db: Path, sql: str, *args) -> list[tuple]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def snapshot(d: Path) -> dict[str, tuple[int, str]]:
    """Every file in d: mode and content hash."""
    return {
        f.name: (f.lstat().st_mode, hashlib.sha256(f.read_bytes()).hexdigest())
        for f in sorted(d.iterdir())
        if f.is_file() and not f.is_symlink()
    }


@pytest.fixture
def busy() -> Iterator[Target]:
    """gf_target calling gf_empty as fast as it can until it is killed."""
    t = Target()
    assert t.p.stdin is not None
    t.p.stdin.write("empty 1000000000000\n")
    t.p.stdin.flush()
    yield t
    t.p.kill()
    t.p.wait(timeout=10)


def start_trace(pid: int, db: Path, *extra: str, **kw) -> subprocess.Popen[str]:
    """`gpufault trace -q --no-summary --pid PID --lib LIB --fn gf_empty`,
    returned once its --ready-fd line says the probes are live. No summary:
    these tests time the stop, and the summary's cost grows with the rows
    (bounded by its own 2 s budget, test_summary.py)."""
    p, _ = start_ready(
        [
            *GF,
            "trace",
            "-q",
            "--no-summary",
            "--pid",
            str(pid),
            "--lib",
            str(LIB),
            "--fn",
            "gf_empty",
            "--db",
            str(db),
            *extra,
        ],
        cwd=REPO,
        **kw,
    )
    return p


def ended_within(p: subprocess.Popen[str], limit: float) -> tuple[float, str]:
    """Wait for p (not a sleep): its run time from now and its stderr."""
    t0 = time.monotonic()
    try:
        _, err = finish(p, limit + 30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        pytest.fail(f"gpufault did not stop within {limit + 30:.0f} s")
    took = time.monotonic() - t0
    assert took < limit, (took, err)
    return took, err


def run_row(db: Path) -> tuple[str, dict]:
    ((status, stats),) = q(db, "SELECT status, stats FROM runs")
    return status, json.loads(stats)


def accounted(db: Path) -> tuple[int, int]:
    """(calls BPF counted, calls accounted for: rows + dropped + lost +
    unfinished, those in flight when the probes were detached)."""
    status, st = run_row(db)
    assert status == "done"
    rows = q(db, "SELECT count(*) FROM calls")[0][0]
    lost = sum(v for k, v in st.items() if k.endswith(("_lost", "_err")))
    return st["calls"], rows + st["calls_dropped"] + lost + st["calls_unfinished"]


# ---- 1. trace mode stops at any call rate; the database is capped ----------


def test_trace_duration_ends_at_a_high_call_rate(busy: Target, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    p = start_trace(busy.pid, db, "--duration", "2s", "--max-db-size", "0")
    took, err = ended_within(p, 2 + SLACK_S)
    assert p.returncode == 0, err
    assert took >= 1.9
    calls, seen = accounted(db)
    assert calls > 100_000  # it was loaded: ~500k calls/s here
    # Every call BPF counted is a row, or counted lost, dropped or
    # unfinished (its entry still in flight at detach), exactly. The call
    # in flight when the run disarmed used to escape: disarming zeroed the
    # spec its return program reads; now it only clears the enabled flag.
    assert seen == calls, (calls, seen)


def test_sigint_ends_a_trace_at_a_high_call_rate(busy: Target, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    p = start_trace(busy.pid, db, "--max-db-size", "0")
    deadline = time.monotonic() + 20
    while not q(db, "SELECT count(*) FROM calls LIMIT 1")[0][0]:  # rows are streaming in
        assert time.monotonic() < deadline
    p.send_signal(signal.SIGINT)
    _, err = ended_within(p, SLACK_S)
    assert p.returncode == 0, err
    calls, seen = accounted(db)
    assert seen == calls, (calls, seen)


def test_sigterm_ends_a_trace_at_a_high_call_rate(busy: Target, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    p = start_trace(busy.pid, db, "--max-db-size", "0")
    deadline = time.monotonic() + 20
    while not q(db, "SELECT count(*) FROM calls LIMIT 1")[0][0]:
        assert time.monotonic() < deadline
    p.send_signal(signal.SIGTERM)
    ended_within(p, SLACK_S)
    assert run_row(db)[0] == "done"


def test_target_exit_ends_a_trace_at_a_high_call_rate(busy: Target, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    p = start_trace(busy.pid, db, "--max-db-size", "0")
    deadline = time.monotonic() + 20
    while not q(db, "SELECT count(*) FROM calls LIMIT 1")[0][0]:
        assert time.monotonic() < deadline
    busy.p.kill()
    busy.p.wait(timeout=10)
    _, err = ended_within(p, SLACK_S)
    assert p.returncode == 0 and f"pid {busy.pid} exited" in err, err
    assert run_row(db)[0] == "done"


def test_size_cap_stops_growth_with_one_message_and_a_count(busy: Target, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    p = start_trace(busy.pid, db, "--duration", "3s", "--max-db-size", "1M")
    _, err = ended_within(p, 3 + SLACK_S)
    assert p.returncode == 0, err
    notes = [ln for ln in err.splitlines() if "reached --max-db-size" in ln]
    assert len(notes) == 1 and notes[0].startswith("gpufault: ") and "1 MiB" in notes[0], err
    status, st = run_row(db)
    assert status == "done" and st["calls_dropped"] > 100_000, st
    summary = [ln for ln in err.splitlines() if ln.startswith("run ")]
    assert summary and f"{st['calls_dropped']} dropped (--max-db-size)" in summary[-1], err
    # Growth stopped about one batch past the cap, where the dropped rows
    # alone would have taken tens of MiB.
    size = sum(f.stat().st_size for f in tmp_path.glob("gf.db*"))
    assert size < 8 << 20, size
    calls, seen = accounted(db)
    assert seen == calls, (calls, seen)


def test_max_db_size_is_parsed_with_units(target: Target, tmp_path: Path) -> None:
    res = gf(
        *on_victim("trace", target.pid),
        "--max-db-size",
        "lots",
        "--db",
        str(tmp_path / "gf.db"),
    )
    assert res.returncode == 2 and "--max-db-size" in res.stderr, res
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "gf.db").exists()


# ---- 2. a bad --db is found before anything is armed ------------------------


def test_non_sqlite_db_is_refused_before_arming(target: Target, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    db.write_text("not a database\n" * 100)
    before, snap = bpf_progs(), snapshot(tmp_path)
    res = gf(
        *on_victim("inject", target.pid),
        "--action",
        "fail",
        "--ret",
        "-5",
        "--every",
        "1",
        "--db",
        str(db),
    )
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "not an SQLite database" in lines[0], res.stderr
    assert snapshot(tmp_path) == snap
    assert no_new_progs(before)
    assert [r[3] for r in target.victim(3)] == [2, 3, 4]


def _in_private_mount_ns(script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a shell script in a new private mount namespace: its mounts end
    with it."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_read_only_filesystem_is_refused_before_arming(target: Target, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    before = bpf_progs()
    res = _in_private_mount_ns(
        f"mount -t tmpfs -o ro,size=1m gftest {ro} && exec {sys.executable} -m pyctl inject "
        f"--pid {target.pid} --lib {LIB} --fn gf_victim --action fail --ret -5 --every 1 "
        f"--db {ro}/gf.db"
    )
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpufault: "), res.stderr
    assert "Read-only file system" in lines[0], res.stderr
    assert no_new_progs(before)
    assert [r[3] for r in target.victim(3)] == [2, 3, 4]
    assert not list(ro.iterdir())


def test_disk_full_mid_run_stops_faults_and_fails_the_run(busy: Target, tmp_path: Path) -> None:
    full, out = tmp_path / "full", tmp_path / "out"
    full.mkdir()
    out.mkdir()
    before = bpf_progs()
    t0 = time.monotonic()
    res = _in_private_mount_ns(
        f"mount -t tmpfs -o size=2m,mode=0700 gftest {full} || exit 99; "
        f"{sys.executable} -m pyctl trace -q --pid {busy.pid} --lib {LIB} --fn gf_empty "
        f"--max-db-size 0 --duration 60s --db {full}/gf.db; rc=$?; "
        f"cp -a {full}/. {out}/; exit $rc"
    )
    took = time.monotonic() - t0
    assert res.returncode == 3, res
    assert took < 30, took  # not the 60 s --duration: the failed write ended it
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gpufault: ")]
    assert len(lines) == 1 and "database or disk is full" in lines[0], res.stderr
    assert "marked failed" in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert no_new_progs(before)
    db = out / "gf.db"
    assert q(db, "PRAGMA integrity_check") == [("ok",)]
    status, st = run_row(db)
    assert status == "failed" and "disk is full" in st["write_error"], st
    assert q(db, "SELECT count(*) FROM calls")[0][0] > 0  # what was written is kept
    assert not list(full.iterdir())  # the tmpfs went with its namespace


# ---- 3. --db safety --------------------------------------------------------


def test_symlink_as_db_is_refused(target: Target, tmp_path: Path) -> None:
    link, dest = tmp_path / "gf.db", tmp_path / "elsewhere.db"
    link.symlink_to(dest)  # dangling
    res = gf(
        *on_victim("trace", target.pid),
        "--duration",
        "1s",
        "--db",
        str(link),
    )
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "symbolic link" in lines[0], res.stderr
    assert not dest.exists()
    res = gf("faults", "--db", str(link))
    assert res.returncode == 2 and "symbolic link" in res.stderr
    assert not dest.exists()


def test_missing_directory_is_not_created(target: Target, tmp_path: Path) -> None:
    db = tmp_path / "no" / "such" / "gf.db"
    res = gf(
        *on_victim("trace", target.pid),
        "--duration",
        "1s",
        "--db",
        str(db),
        preexec_fn=lambda: os.umask(0),
    )
    assert res.returncode == 2 and "no such directory" in res.stderr, res
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "no").exists()


def test_foreign_sqlite_db_is_never_modified(target: Target, tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE notes (x TEXT)")
    con.execute("INSERT INTO notes VALUES ('mine')")
    con.commit()
    con.close()
    os.chmod(other, 0o644)
    snap = snapshot(tmp_path)
    before = bpf_progs()
    for args in (
        ["faults"],
        ["faults", "--json"],
        ["show", "1a2b3c4d-1"],
        [
            *on_victim("trace", target.pid),
            "--duration",
            "1s",
        ],
    ):
        res = gf(*args, "--db", str(other))
        assert res.returncode == 2, (args, res)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "not a gpufault database" in lines[0], (args, res.stderr)
        assert snapshot(tmp_path) == snap, args  # same bytes, mode 0644, no -wal/-shm
    assert no_new_progs(before)
    assert q(other, "PRAGMA journal_mode") == [("delete",)]


def test_new_db_is_root_only_and_readers_write_nothing(target: Target, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    ctl, _ = start_ready(
        [
            *GF,
            *on_victim("inject", target.pid),
            "-q",
            "--action",
            "fail",
            "--ret",
            "-5",
            "--nth",
            "2",
            "--db",
            str(db),
        ],
        cwd=REPO,
        preexec_fn=lambda: os.umask(0),
    )
    assert [r[3] for r in target.victim(3)] == [2, -5, 4]
    deadline = time.monotonic() + 20
    # The fault's row is in (the WAL and SHM exist): a copilot fire's with
    # its outcome, a signal-path fire's at once (its helper counts come at
    # the end of the run).
    while not q(db, "SELECT count(*) FROM faults")[0][0]:
        assert time.monotonic() < deadline
    for f in tmp_path.glob("gf.db*"):  # the WAL and SHM siblings too
        assert f.stat().st_mode & 0o777 == 0o600, f
    ctl.send_signal(signal.SIGINT)
    finish(ctl, 30)
    assert db.stat().st_mode & 0o777 == 0o600
    snap = snapshot(tmp_path)
    res = gf("faults", "--json", "--db", str(db))
    assert res.returncode == 0, res
    (row,) = json.loads(res.stdout)
    res = gf("show", row["fault_id"], "--db", str(db))
    assert res.returncode == 0 and "injected -5" in res.stdout, res
    assert snapshot(tmp_path) == snap  # no -wal/-shm created, no chmod, same bytes


def test_store_refuses_bad_paths_one_line(tmp_path: Path) -> None:
    """The store's own checks, without BPF."""
    (tmp_path / "d").mkdir()
    with pytest.raises(store.StoreError, match="not a regular file"):
        store.open_db(tmp_path / "d")
    with pytest.raises(store.StoreError, match="no database"):
        store.open_db(tmp_path / "none.db", readonly=True)
    assert not (tmp_path / "none.db").exists()
    db = store.open_db(tmp_path / "new.db")
    db.close()
    ro = store.open_db(tmp_path / "new.db", readonly=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        ro.conn.execute("INSERT INTO runs (run_id) VALUES ('x')")
    ro.close()


def test_only_the_default_path_gets_its_directories_0700(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = tmp_path / "var" / "lib" / "gpufault" / "gpufault.db"
    monkeypatch.setattr(store, "DEFAULT_DB", default)
    old = os.umask(0)
    try:
        with pytest.raises(store.StoreError, match="no such directory"):
            store.open_db(tmp_path / "other" / "gf.db")
        store.open_db(default).close()
    finally:
        os.umask(old)
    assert not (tmp_path / "other").exists()
    for d in (tmp_path / "var", tmp_path / "var" / "lib", default.parent):
        assert d.stat().st_mode & 0o777 == 0o700, d
    assert default.stat().st_mode & 0o777 == 0o600


# ---- 4. nothing fires before the copilot holds the target; no phantom -------


def test_no_fire_before_the_copilot_holds_a_busy_target(tmp_db: Path) -> None:
    n, rate = 1_500_000, 250_000  # ~6 s of calls, started before gpufault attaches
    t = Target()
    try:
        assert t.p.stdin is not None and t.p.stdout is not None
        t.p.stdin.write(f"pace {n} {rate}\n")
        t.p.stdin.flush()
        s = FaultSpec(
            lib=str(LIB),
            fn="gf_empty",
            action="fail",
            ret=-5,
            nth=100,
            tgid=t.pid,
            capture_stack=False,
        )
        eng = Engine([s], db_path=tmp_db, pid=t.pid, argv=["test"])
        eng.start()
        try:
            line = t.p.stdout.readline()
            assert t.p.stdout.readline().strip() == "done"
            eng.drain()
            mech = eng.mechanism
        finally:
            eng.close()
    finally:
        t.close()
    acc = int(line.split("acc=")[1])
    ((outcome, fid),) = q(tmp_db, "SELECT outcome, fault_id FROM faults")
    ((arg1,),) = q(tmp_db, "SELECT raw FROM args WHERE fault_id=? AND idx=1", fid)
    # gf_empty(i) returns i: the target's sum shows whether the fired call
    # really returned -5 (i + 5 less than the plain sum).
    assert n * (n - 1) // 2 - acc == arg1 + 5, (line, outcome)
    if mech == "copilot":
        assert json.loads(outcome)["injected"] is True, outcome


def test_fire_without_a_copilot_stop_is_recorded_not_injected(target: Target, tmp_db: Path) -> None:
    s = FaultSpec(lib=str(LIB), fn="gf_victim", action="fail", ret=-5, nth=1, tgid=target.pid)
    eng = Engine(
        [s], db_path=tmp_db, pid=target.pid, argv=["test"], use_regs=False, mechanism="copilot"
    )
    eng.start()
    try:
        eng.copilot.stop()  # the copilot is gone; BPF still fires
        rows = target.victim(2)
        eng.drain()
    finally:
        eng.close()
    assert [r[3] for r in rows] == [2, 3]  # the call returned normally
    ((fid, outcome, ret),) = q(tmp_db, "SELECT fault_id, outcome, ret FROM faults")
    o = json.loads(outcome)
    assert o["injected"] is False and "no copilot stop" in o["error"], o
    assert ret is None  # no observed return, and never the intended -5
    db = store.open_db(tmp_db, readonly=True)
    try:
        text = query.render_chain(query.fault_chain(db, fid))
    finally:
        db.close()
    assert "NOT injected" in text and "injected -5" not in text, text


def test_copilot_warnings_are_printed(tmp_path: Path) -> None:
    # A target that handles SIGURG (as Go runtimes do).
    code = (
        "import signal, sys; signal.signal(signal.SIGURG, lambda *a: None); "
        "print('ready', flush=True); sys.stdin.read()"
    )
    tgt = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert tgt.stdout is not None and tgt.stdout.readline().strip() == "ready"
        ctl, _ = start_ready(
            [
                *GF,
                "inject",
                "-q",
                "--pid",
                str(tgt.pid),
                "--lib",
                "libc",
                "--fn",
                "getppid",
                "--action",
                "fail",
                "--ret",
                "1",
                # The copilot's warnings (the signal path would take SIGWINCH).
                "--mechanism",
                "copilot",
                "--db",
                str(tmp_path / "gf.db"),
            ],
            cwd=REPO,
        )
        # At once, before its loop runs: Ctrl-C still ends the run cleanly.
        ctl.send_signal(signal.SIGINT)
        _, err = finish(ctl, 30)
    finally:
        tgt.kill()
        tgt.wait()
    warn = [ln for ln in err.splitlines() if ln.strip().startswith("warning:")]
    assert any(f"pid {tgt.pid} handles signal {int(signal.SIGURG)}" in w for w in warn), err
    assert ctl.returncode == 0, err
    assert run_row(tmp_path / "gf.db")[0] == "done"
