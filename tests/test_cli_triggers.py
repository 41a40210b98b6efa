"""Trigger values that mean something else, or can never fire (issue 25
item 9): refused with one line, exit 2, nothing attached or written; what a
later load could make fire is one warning line and the run goes on."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from gftarget import LIB, Target, bpf_progs, no_new_progs

from pyctl.spec import FaultSpec, SpecError

GF = [sys.executable, "-m", "pyctl"]


def gf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GF, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"nth": 3, "every": 2}, "call 3 is not a multiple of 2"),
        ({"nth": 2, "after": 5}, "call 2 comes before call 6"),
        ({"window": "10s", "duration_s": 2.0}, "--window 10s starts when --duration 2s"),
    ],
    ids=["nth-every", "nth-after", "window-duration"],
)
def test_impossible_spec_refused_everywhere(fields: dict, needle: str) -> None:
    """Templates and experiment files build specs here too: refused there as well."""
    dur = fields.pop("duration_s", 0.0)
    with pytest.raises(SpecError, match=needle):
        spec = FaultSpec.from_fields({"lib": "libc", "fn": "read", "action": "fail", "ret": -1,
                                      **fields})  # fmt: skip
        spec.check_can_fire(dur)


def test_possible_combinations_stay_accepted() -> None:
    FaultSpec.from_fields({"lib": "libc", "fn": "read", "action": "fail", "ret": -1,
                           "nth": 4, "every": 2, "after": 3})  # fmt: skip
    FaultSpec.from_fields(
        {"lib": "libc", "fn": "read", "action": "fail", "ret": -1, "window": "1s"}
    ).check_can_fire(2.0)
    # A template's knob left at 0 means "not given", as before.
    FaultSpec.from_fields({"lib": "libc", "fn": "read", "action": "fail", "ret": -1, "nth": 0})


@pytest.mark.root
@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nth", "0"], "--nth 0: calls count from 1"),
        (["--every", "0"], "--every 0: calls count from 1"),
        (["--nth", "3", "--every", "2"], "call 3 is not a multiple of 2"),
        (["--nth", "2", "--after", "5"], "call 2 comes before call 6"),
        (["--window", "10s", "--duration", "2s"], "--window 10s starts when --duration 2s"),
        (["--caller", "libnosuch"], "--caller libnosuch: no object of that name"),
        (["--caller", "/nonexistent/libx.so"], "--caller /nonexistent/libx.so: no object"),
    ],
    ids=["nth0", "every0", "nth-every", "nth-after", "window", "caller", "caller-path"],
)
def test_never_fires_refused_one_line_nothing_attached(
    target: Target, tmp_path: Path, args: list[str], needle: str
) -> None:
    db = tmp_path / "gf.db"
    before = bpf_progs()
    res = gf("--db", str(db), "inject", "--pid", str(target.pid), "--lib", str(LIB),
             "--fn", "gf_victim", "--ret", "-5", *args)  # fmt: skip
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpufault: ") and needle in lines[0], lines
    assert not db.exists()
    assert no_new_progs(before)
    assert [r[3] for r in target.victim(3)] == [2, 3, 4]  # untouched


@pytest.mark.root
def test_lib_not_loaded_yet_warns_once_and_runs(target: Target, tmp_path: Path) -> None:
    """gf_target never loads libz: the probes sit on the file, for a later
    dlopen; one warning line says so and the run goes to its --duration."""
    db = tmp_path / "gf.db"
    res = gf("--db", str(db), "inject", "--pid", str(target.pid), "--lib", "libz",
             "--fn", "deflate", "--ret", "-1", "--duration", "1s")  # fmt: skip
    assert res.returncode == 0, res.stderr
    warn = [ln for ln in res.stderr.splitlines() if "warning:" in ln]
    assert len(warn) == 1 and "is not loaded in pid" in warn[0], res.stderr
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT status FROM runs").fetchone() == ("done",)


@pytest.mark.root
def test_caller_not_loaded_yet_warns_once_and_runs(target: Target, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    res = gf("--db", str(db), "inject", "--pid", str(target.pid), "--lib", str(LIB),
             "--fn", "gf_victim", "--ret", "-5", "--caller", "libz", "--duration", "1s",
             "-q")  # fmt: skip
    assert res.returncode == 0, res.stderr
    warn = [ln for ln in res.stderr.splitlines() if "warning:" in ln]
    # Said under -q too: a warning is what the user must know.
    assert len(warn) == 1 and "--caller libz: not mapped" in warn[0], res.stderr
