"""Pointing an experiment file at another server (issue 23, "Any server"):
`experiment run FILE --url URL --pid PID` (or --command), and
`experiment validate FILE --target PID`, which resolves every fault
step's libraries and functions in that process as arming would: a name
it lacks is one line before any baseline, not a failed step after it."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import requires_root
from gftarget import LIB, Target
from service_proc import ServiceProc

from pyctl.experiment import load as F
from pyctl.experiment import model as M

GF_EXP = [sys.executable, "-m", "pyctl", "experiment"]
CONTROL = F.find("control").read_text()


def _with_step(tmp_path: Path, fault: str, name: str = "probe-check") -> Path:
    """control.toml with one fault step (and its own name)."""
    text = CONTROL.replace('name = "control"', f'name = "{name}"', 1)
    text = text.replace("[expect]\n", f"[[method]]\nname = \"the fault\"\nfault = {{ {fault} }}\n"
                        'start = "0s"\nduration = "2s"\n\n[expect]\n', 1)  # fmt: skip
    p = tmp_path / f"{name}.toml"
    p.write_text(text)
    return p


@requires_root
def test_validate_target_resolves_each_step_in_the_process(tmp_path: Path) -> None:
    t = Target()
    try:
        good = _with_step(tmp_path, f'lib = "{LIB}", fn = "gf_vic*", action = "fail", ret = -1')
        r = subprocess.run([*GF_EXP, "validate", str(good), "--target", str(t.pid)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert f"resolved in pid {t.pid})" in r.stdout
        assert "gf_victim in" in r.stdout and "libgftarget.so" in r.stdout, r.stdout
        fault = f'lib = "{LIB}", fn = "gf_no_such_fn", action = "fail", ret = -1'
        bad = _with_step(tmp_path, fault, name="probe-bad")
        t0 = time.monotonic()
        r = subprocess.run([*GF_EXP, "validate", str(bad), "--target", str(t.pid)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        took = time.monotonic() - t0
        assert r.returncode == 2, r
        (line,) = r.stderr.strip().splitlines()
        assert f"step 1 (the fault) in pid {t.pid}: " in line and "gf_no_such_fn" in line, line
        print(f"validate --target refused in {took:.2f}s")
        # Without --target the file itself is fine: the name is the process's problem.
        r = subprocess.run([*GF_EXP, "validate", str(bad)], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        lib_bad = _with_step(tmp_path, 'lib = "libgf-nowhere", fn = "f", action = "fail", ret = -1',
                             name="probe-nolib")  # fmt: skip
        r = subprocess.run([*GF_EXP, "validate", str(lib_bad), "--target", str(t.pid)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and "libgf-nowhere" in r.stderr, r
    finally:
        t.close()


def test_target_overrides_are_checked_before_anything_runs(tmp_path: Path) -> None:
    for args, want in (
        (["--url", "http://127.0.0.1:1"], "--url and --ready go with --pid PID or --command CMD"),
        (["--pid", "1", "--command", "x"], "--pid and --command both name the process"),
        (["--pid", "1"], "target.url: missing: a pid target needs the service's url"),
        (["--command", "'unclosed"], "--command: No closing quotation"),
        (["--all", "--pid", "1", "--url", "http://x"], "--all runs the shipped files"),
    ):
        r = subprocess.run([*GF_EXP, "run", *(["control"] if "--all" not in args else []), *args,
                            "--db", str(tmp_path / "x.db")], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        assert r.returncode == 2, r
        (line,) = r.stderr.strip().splitlines()
        assert want in line, line
    assert not (tmp_path / "x.db").exists()
    # A file's GPU requirement stays with it when another server is named.
    e = F.load("cuda-oom-leak-held", {"device": "cuda"},
               {"url": "http://127.0.0.1:9", "pid": 1})  # fmt: skip
    assert e.target.pid == 1 and e.target.needs_gpu
    with pytest.raises(M.ExperimentError, match=r"its target from --url/--pid/--command"):
        F.load("control", None, {"url": "ftp://x", "pid": 1})


@requires_root
def test_run_against_a_server_by_pid_refuses_a_missing_function_before_the_baseline(
    tmp_path: Path,
) -> None:
    s = ServiceProc("--batch-wait", "0")
    try:
        bad = _with_step(tmp_path, 'lib = "libc", fn = "gf_no_such_fn", action = "fail", ret = -1',
                         name="any-server-bad")  # fmt: skip
        db = tmp_path / "x.db"
        t0 = time.monotonic()
        at = ["--url", s.url, "--pid", str(s.pid), "--db", str(db)]
        r = subprocess.run([*GF_EXP, "run", str(bad), *at], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        took = time.monotonic() - t0
        assert r.returncode == 2, r
        assert f"step 1 (the fault) in pid {s.pid}: " in r.stderr and "gf_no_such_fn" in r.stderr
        assert "baseline" not in r.stdout, r.stdout
        print(f"run --pid refused a missing function in {took:.2f}s (baseline alone is 4 s)")
        if db.exists():
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            assert con.execute("SELECT count(*) FROM experiments").fetchone()[0] == 0
            con.close()
        # The same file with a function libc has runs to its verdict there.
        good = _with_step(tmp_path, 'lib = "libc", fn = "getpid", action = "observe"',
                          name="any-server-good")  # fmt: skip
        r = subprocess.run([*GF_EXP, "run", str(good), *at], capture_output=True, text=True,
                           timeout=180)  # fmt: skip
        assert f"against {s.url} (pid {s.pid})" in r.stdout, r.stdout + r.stderr
        assert "verdict " in r.stdout, r.stdout + r.stderr
        assert s.proc.poll() is None  # the server gpufault did not start keeps running
    finally:
        assert s.close() == 0, s.stderr()
