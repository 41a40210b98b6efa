"""A plain `trace --pid` attaches from the entry, before click and the CLI
are imported (pyctl/early.py, issue 26): the run it records is the one
the CLI's own start records (the same rows, the same summary), a line
the early reader takes but click refuses still ends in click's one line
with nothing left behind, and the run takes the early probes only when
the CLI built the same run. Real BPF on gf_target; the wrapper below is
the entry with `runner.take_early` reporting what it handed over."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from gftarget import LIB, REPO, Target
from procio import finish, start_controller

from pyctl.argv import plain_trace

# `gpufault ARGS`, with one stderr line saying whether the runner took an
# early engine (before the run's own lines).
WRAP = """
import sys
import pyctl.runner as R
take = R.take_early
def taken(*a):
    e = take(*a)
    print("early-taken", e is not None, file=sys.stderr, flush=True)
    return e
R.take_early = taken
from pyctl.entry import main
sys.argv[0] = "gpufault"
main()
"""
OFF = {"GPUFAULT_NO_EARLY_ATTACH": "1"}


def _gf(args: list[str]) -> list[str]:
    return [sys.executable, "-c", WRAP, *args]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "GPUFAULT_NO_SERVER": "1", **(extra or {})}


# ---- the reader (no root) ---------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "trace --pid 12 --lib libz --fn crc32",
        "--db /tmp/x.db trace -p 12 --lib=libz --fn crc32 --fn=adler* --no-stack",
        "trace --lib libz --fn crc32 --pid=12 --duration 2s -q --entry-only --no-summary --json",
    ],
)
def test_plain_trace_lines_are_read(line: str) -> None:
    p = plain_trace(line.split())
    assert p is not None and p.pid == 12 and p.lib == "libz" and p.fn[0] == "crc32"


@pytest.mark.parametrize(
    "line",
    [
        "inject --pid 12 --lib libz --fn crc32",
        "trace --pid 12 --lib libz --fn crc32 --tid 3",  # an option it does not read
        "trace --pid 12 --pid 13 --lib libz --fn crc32",  # twice: click's rule, not ours
        "trace --pid 12 --lib libz --fn crc32 -- ls",
        "trace --pid 12 --lib libz",  # no --fn
        "trace --pid x --lib libz --fn crc32",
        "trace --pid 12 --lib libz --fn --no-stack",  # a value that is an option
        "--debug trace --pid 12 --lib libz --fn crc32",
        "trace --pid 12 --lib libz --fn crc32 --db",
    ],
)
def test_other_lines_go_to_click_alone(line: str) -> None:
    assert plain_trace(line.split()) is None


# ---- the runs (root, real BPF) ----------------------------------------------


def _trace(t: Target, db: Path, extra: dict[str, str] | None, calls: int) -> tuple[str, str]:
    """One trace of t while it makes `calls` calls, ended by SIGINT; its
    stderr and stdout (the summary)."""
    ctl, lines = start_controller(
        _gf(["trace", "--pid", str(t.pid), "--lib", str(LIB), "--fn", "gf_victim",
             "--db", str(db)]),  # fmt: skip
        env=_env(extra),
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    t.victim(calls)
    ctl.send_signal(signal.SIGINT)
    out, err = finish(ctl, timeout=60)
    assert ctl.returncode == 0, "".join(lines) + err
    return "".join(lines) + err, out


# Columns two runs of the same calls differ in by nature: ids and times,
# the calling thread (gf_target starts one per `victim`), the argument
# registers (pointers, and what is left in those past the arity).
VARY = {"run_id", "started", "ended", "ts_ns", "latency_ns", "stats", "tid",
        "arg1", "arg2", "arg3", "arg4", "arg5", "arg6"}  # fmt: skip


def _rows(db: Path, run_id: str) -> dict[str, list[tuple]]:
    """The run's rows in every table that has them, without what differs
    between two runs by nature (ids, times, the argv's own position)."""
    out: dict[str, list[tuple]] = {}
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            cols = [r[1] for r in con.execute(f"PRAGMA table_info({table})")]
            if "run_id" not in cols:
                continue
            keep = [c for c in cols if c not in VARY]
            out[table] = sorted(
                tuple(r[c] for c in keep)
                for r in con.execute(f"SELECT * FROM {table} WHERE run_id = ?", (run_id,))
            )
    finally:
        con.close()
    return out


def _run_ids(db: Path) -> list[str]:
    with sqlite3.connect(db) as con:
        return [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY started")]


@pytest.mark.root
def test_the_early_run_stores_what_the_clis_own_start_stores(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    t = Target()
    try:
        err_early, out_early = _trace(t, db, None, 5)
        err_cli, out_cli = _trace(t, db, OFF, 5)
    finally:
        t.close()
    assert "early-taken True" in err_early, err_early
    assert "early-taken False" in err_cli, err_cli
    early, cli = _run_ids(db)
    a, b = _rows(db, early), _rows(db, cli)
    assert a["runs"] == b["runs"] and a["specs"] == b["specs"] and a["funcs"] == b["funcs"]
    for table in a:
        assert a[table] == b[table], (table, a[table], b[table])
    with sqlite3.connect(db) as con:
        for run in (early, cli):
            q = "SELECT call_seq FROM calls WHERE run_id = ? ORDER BY call_seq"
            seqs = [r[0] for r in con.execute(q, (run,))]
            assert seqs == [1, 2, 3, 4, 5], (run, seqs)
            # The run row starts no later than its first call (the early
            # probes were armed before the row was written).
            started, first = con.execute(
                "SELECT started, (SELECT min(ts_ns) FROM calls WHERE run_id = ?) FROM runs "
                "WHERE run_id = ?",
                (run, run),
            ).fetchone()
            assert started is not None and first is not None
    # The same start-up and closing lines, and the summary's counts (its
    # latencies and the run's length differ by nature).
    def head(s: str, run: str) -> list[str]:
        lines = s.replace(run, "RUN").splitlines()
        hist = re.compile(r"\s*(\d+ -> \d+|nsecs|latency) ")
        return [ln.split(" in ")[0] for ln in lines if ln.strip() and not hist.match(ln)]

    assert head(out_early, early) == head(out_cli, cli)
    assert head(err_early, early)[1:] == head(err_cli, cli)[1:]
    assert "calls 5" in out_early, out_early


@pytest.mark.root
@pytest.mark.parametrize(
    "extra",
    [
        ["--no-stack", "-q"],
        ["--entry-only", "--no-summary"],
        ["--fn", "gf_empty", "--json", "--per-thread"],
    ],
)
def test_each_option_the_reader_takes_builds_the_same_run(
    tmp_path: Path, extra: list[str]
) -> None:
    """The spec and settings pyctl/early.py builds equal the CLI's for every
    option plain_trace reads: else the runner closes the early engine and
    starts its own (correct, but the early attach bought nothing)."""
    t = Target()
    db = tmp_path / "gf.db"
    try:
        args = ["--db", str(db), "trace", "--pid", str(t.pid), "--lib", str(LIB),
                "--fn", "gf_victim", "--duration", "0.3s", *extra]  # fmt: skip
        r = subprocess.run(_gf(args), env=_env(), capture_output=True, text=True, cwd=REPO,
                           timeout=60)  # fmt: skip
    finally:
        t.close()
    assert r.returncode == 0, r.stderr
    assert "early-taken True" in r.stderr, r.stderr


@pytest.mark.root
@pytest.mark.parametrize(
    "bad",
    [
        ["--duration", "0"],  # the early reader's parse refuses it first: click's line
        ["--db", "DIR"],  # attached early; click refuses a directory
        ["--db", "MISSING/gf.db"],  # attached early; the store's open refuses it
        ["--fn", "no_such_symbol"],  # the early start refuses it: the CLI says why
    ],
)
def test_a_bad_line_ends_in_the_same_one_line_and_leaves_nothing(
    tmp_path: Path, bad: list[str]
) -> None:
    t = Target()
    (tmp_path / "DIR").mkdir()
    bad = [b.replace("DIR", str(tmp_path / "DIR")).replace("MISSING", str(tmp_path / "no"))
           for b in bad]  # fmt: skip
    db = ["--db", str(tmp_path / "gf.db")] if "--db" not in bad else []
    try:
        got = []
        for extra in (None, OFF):
            args = ["trace", "--pid", str(t.pid), "--lib", str(LIB), "--fn", "gf_victim",
                    *db, *bad]  # fmt: skip
            r = subprocess.run(_gf(args), env=_env(extra), capture_output=True, text=True,
                               cwd=REPO, timeout=60)  # fmt: skip
            lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("early-taken")]
            got.append((r.returncode, lines))
        assert len(t.victim(2)) == 2  # the target runs on, unharmed
    finally:
        t.close()
    (rc, lines), (rc_off, lines_off) = got
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("gpufault: "), got
    assert (rc, lines) == (rc_off, lines_off)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["DIR"]
    assert not any((tmp_path / "DIR").iterdir())


# ---- python -S -m pyctl (pyctl/__main__.py) ---------------------------------

# Where pyctl.__main__ left the interpreter: its site-packages on sys.path
# (without their .pth files) or `site` run after all.
PROBE = (
    "import sys, pyctl.__main__\n"
    "import click, rust_demangler\n"
    "print('site' if 'sitecustomize' in sys.modules or any(p.endswith('marker') for p in sys.path)"
    " else 'no-site')\n"
)


def _venv(where: Path, *, deps_inside: bool) -> str:
    """A venv whose site-packages holds a .pth naming a `marker` directory,
    and the dependencies either copied in (found under -S) or reachable
    only through a second .pth (found only once `site` runs)."""
    import importlib

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = next((where / "lib").glob("python3*/site-packages"))
    (where / "marker").mkdir()
    (site / "marker.pth").write_text(str(where / "marker") + "\n")
    for dep in ("click", "rust_demangler"):
        src = Path(importlib.import_module(dep).__file__ or "").parent
        if deps_inside:
            import shutil

            shutil.copytree(src, site / dep)
        else:
            (site / f"{dep}.pth").write_text(str(src.parent) + "\n")
    return str(where / "bin" / "python")


def test_no_site_puts_site_packages_on_the_path_without_their_pth(tmp_path: Path) -> None:
    py = _venv(tmp_path / "v", deps_inside=True)
    r = subprocess.run([py, "-S", "-c", PROBE], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)  # fmt: skip
    assert r.stdout.strip() == "no-site", r


def test_no_site_falls_back_to_site_when_a_dependency_needs_a_pth(tmp_path: Path) -> None:
    py = _venv(tmp_path / "v", deps_inside=False)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([py, "-S", "-c", PROBE], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "site", r
    # and the command itself runs so
    v = subprocess.run([py, "-S", "-m", "pyctl", "--version"], capture_output=True, text=True,
                       env=env, cwd=tmp_path)  # fmt: skip
    assert v.returncode == 0 and "gpufault" in v.stdout, v


# `gpufault serve` whose controllers say what runner.take_early handed over
# (forked from it: the patched module is theirs too).
SERVER = WRAP.replace('sys.argv[0] = "gpufault"', 'sys.argv = ["gpufault", "serve"]')


@pytest.mark.root
def test_a_served_plain_trace_attaches_before_its_cli_too(tmp_path: Path) -> None:
    # lazy: test_resident's server helpers (a module of tests: only here)
    from test_resident import _env as served_env
    from test_resident import served_line, server

    run_dir, db = tmp_path / "run", tmp_path / "gf.db"
    t = Target()
    try:
        with server(run_dir, SERVER) as srv:
            argv = [sys.executable, "-m", "pyctl", "trace", "--pid", str(t.pid), "--lib",
                    str(LIB), "--fn", "gf_victim", "--db", str(db)]  # fmt: skip
            ctl, lines = start_controller(argv, env=served_env(run_dir), stdout=subprocess.PIPE,
                                          cwd=REPO)  # fmt: skip
            _client, controller, _cmd = served_line(srv)
            assert len(t.victim(7)) == 7
            ctl.send_signal(signal.SIGINT)
            out, err = finish(ctl, timeout=60)
            assert ctl.returncode == 0, err
    finally:
        t.close()
    said = "".join(lines) + err
    assert "early-taken True" in said, said
    assert "calls 7" in out, out
    with sqlite3.connect(db) as con:
        seqs = [r[0] for r in con.execute("SELECT call_seq FROM calls ORDER BY call_seq")]
    assert seqs == list(range(1, 8))
