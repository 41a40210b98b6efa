"""The commands' library side (pyctl.api: doctor, reading, errors, hooks,
netchaos, tokenizer): what a command prints is what the API returns, and
the API's errors are the hierarchy's, with the command's one line. No
root needed except where marked; the evidence is tests/evidence_rows.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from evidence_rows import fill, gf

from pyctl import api
from pyctl.api import doctor, errors, hooks, netchaos, reading, tokenizer
from pyctl.bpf.libbpf import BpfError
from pyctl.exceptions import BadInput, EvidenceWriteError, MissingPrerequisite

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def evidence(tmp_path: Path) -> tuple[Path, dict]:
    db = tmp_path / "gf.db"
    return db, fill(db)


def test_show_and_faults_print_what_the_api_returns(evidence) -> None:
    path, ids = evidence
    db = reading.open_readonly(path)
    one = reading.show(db, ids["faults"][0], db_path=str(path))
    assert one.one and one.to_json()["fault"]["fault_id"] == ids["faults"][0]
    rc, out = gf("show", ids["faults"][0], "--db", str(path))
    assert rc == 0 and out == one.render() + "\n"
    run = reading.show(db, ids["run"], limit=2, db_path=str(path))
    assert not run.one and run.more == 1 and len(run.docs) == 2
    rc, out = gf("show", ids["run"], "--limit", "2", "--db", str(path))
    assert rc == 0 and out == run.render() + "\n"
    assert "... 1 more fault in run" in out
    rows, more = reading.fault_list(db, limit=2)
    assert len(rows) == 2 and more == 1
    rc, out = gf("faults", "--limit", "2", "--json", "--db", str(path))
    assert rc == 0 and json.loads(out) == rows


def test_readers_raise_bad_input_with_the_commands_line(evidence, tmp_path: Path) -> None:
    path, ids = evidence
    db = reading.open_readonly(path)
    with pytest.raises(BadInput, match=r"no fault \w+-9 in .*: list them with `gpufault faults`"):
        reading.show(db, f"{ids['run']}-9", db_path=str(path))
    rc, out = gf("show", f"{ids['run']}-9", "--db", str(path))
    assert rc == 2 and out.startswith(f"gpufault: no fault {ids['run']}-9 in")
    with pytest.raises(BadInput):
        reading.timeline(db, "nosuchrun")
    with pytest.raises(BadInput):  # the store's StoreError: nothing is created
        reading.open_readonly(tmp_path / "absent.db")
    assert not (tmp_path / "absent.db").exists()
    doc = reading.timeline(db, ids["run"])
    rc, out = gf("timeline", ids["run"], "--json", "--db", str(path))
    assert rc == 0 and json.loads(out) == json.loads(json.dumps(doc.to_json()))
    assert "cuMemAlloc_v2 #3 fail" in reading.render_timeline(doc)


def test_cli_line_is_the_commands_status_and_text() -> None:
    assert errors.cli_line(EvidenceWriteError("disk full")) == (3, "disk full")
    assert errors.cli_line(BadInput("--nth: 'x' is bad")) == (2, "--nth: 'x' is bad")
    assert errors.cli_line(ValueError("plain")) == (2, "plain")
    # A kernel refusal gets the hint main() always added.
    assert errors.cli_line(BpfError("load failed")) == (2, "load failed: see `gpufault doctor`")
    assert errors.cli_line(MissingPrerequisite("no catalog installed")) == (
        2,
        "no catalog installed",
    )
    assert errors.cli_line(RuntimeError("a bug")) is None
    assert errors.cli_line(PermissionError("EPERM")) is None  # main's: "run as root"


def test_doctor_json_is_the_reports() -> None:
    rep = doctor.report(["trace", "xids"])
    args = [sys.executable, "-m", "pyctl", "doctor", "--for", "trace", "--for", "xids"]
    r = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert json.loads(r.stdout) == rep.to_json()
    assert r.returncode == (0 if rep.ok else 1)
    text = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO)
    lines = [x for x in text.stdout.splitlines() if not x.startswith(" ")]
    assert [x.split()[1] for x in lines[:2]] == [c.name for c in rep.checks[:2]]
    assert text.stderr == ("" if rep.ok else f"gpufault: {rep.failure_line()}\n")
    with pytest.raises(BadInput, match="unknown feature 'gpu'"):
        doctor.report(["gpu"])
    assert doctor.report(["all"]).features == list(doctor.FEATURES)


def test_user_facing_names_are_exported_lazily() -> None:
    code = (
        "import sys, json, pyctl.api as a; before = set(sys.modules); "
        "a.show, a.DoctorReport, a.netchaos.Stop, a.doctor.report; "
        "print(json.dumps(sorted(m for m in before if m.startswith('pyctl.api.'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       check=True)  # fmt: skip
    assert json.loads(r.stdout) == []  # nothing until asked
    assert api.show is reading.show and api.netchaos is netchaos and api.doctor is doctor
    import gpufault

    assert gpufault.fault_list is reading.fault_list and gpufault.hooks is hooks


def test_hook_and_netchaos_errors_are_the_hierarchys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(MissingPrerequisite, match="none.so is missing: build it with make build"):
        hooks.preload_env("cuFoo:nth=1", so=tmp_path / "none.so")
    # A program that is not there: BadInput (or, without `make build`, the shim missing).
    built = hooks.PRELOAD_SHIM.exists()
    with pytest.raises(BadInput if built else MissingPrerequisite):
        hooks.preload(tmp_path / "gf.db", "cuMemAlloc_v2:nth=1:ret=2", ["/no/such/program"])
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(MissingPrerequisite, match="netchaos loss needs root"):
        netchaos.loss(tmp_path / "gf.db", 5.0, for_s=1)
    assert not (tmp_path / "gf.db").exists()  # refused before anything was written
    with pytest.raises(MissingPrerequisite, match="cleanup needs root"):
        netchaos.cleanup()


def test_a_stop_ends_a_window_with_its_reason() -> None:
    stop = netchaos.Stop()
    assert stop.wait(0) is False and stop.reason == "duration"
    stop.set("SIGTERM")
    assert stop.wait(None) is True and stop.reason == "SIGTERM"


def test_tokenizer_campaign_records_a_run_and_closes_it(tmp_path: Path) -> None:
    from pyctl.evidence import store

    with pytest.raises(BadInput, match="no weakened target for 'nope'"):
        tokenizer.weaken(object(), "nope")
    db = tmp_path / "gf.db"
    c = tokenizer.campaign("fuzz", db, argv=["gpufault", "tokenizer", "fuzz"])
    with pytest.raises(KeyboardInterrupt), c:
        raise KeyboardInterrupt  # a campaign cut short is a failed run, closed
    conn = store.open_db(db, readonly=True)
    row = conn.conn.execute("SELECT kind, status FROM runs WHERE run_id=?", (c.run_id,)).fetchone()
    assert tuple(row) == ("tokenizer:fuzz", "failed")
    with tokenizer.campaign("fuzz", None, no_db=True) as rec:
        assert rec.run_id == tokenizer.NO_DB_RUN
