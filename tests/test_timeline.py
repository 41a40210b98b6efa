"""`gpufault timeline`: a run's faults, links, Xids and anchors in time
order from the run's start, one line each (80 columns on a terminal, whole
elsewhere), and --json. Rows built with the store's functions
(tests/evidence_rows.py): no root, no BPF."""

from __future__ import annotations

import json
from pathlib import Path

from evidence_rows import gf

from pyctl.evidence import store
from pyctl.evidence import timeline as tl


def test_events_in_time_order_with_relative_times(evidence: dict) -> None:
    rc, out = gf("timeline", evidence["run"], "--db", evidence["db"])
    assert rc == 0, out
    lines = out.splitlines()  # not a terminal: every line whole
    db = store.open_db(evidence["db"], readonly=True)
    on_a_terminal = tl.render(tl.build(db, evidence["run"])).splitlines()
    db.close()
    assert len(on_a_terminal) == len(lines) and all(len(ln) <= 80 for ln in on_a_terminal)
    body = [ln.split(None, 3) for ln in lines[1:]]
    kinds = [b[2] for b in body]
    assert kinds == [
        "run",
        "signal",
        "fault",
        "error",
        "xid",
        "anchor",
        "fault",
        "fault",
        "signal",
        "exit",
        "run",
    ]
    times = [float(b[0]) for b in body]
    assert times == sorted(times) and times[0] == 0.0
    assert [round(t, 3) for t in times] == [
        0.0,
        0.005,
        0.01,
        0.012,
        0.015,
        0.018,
        0.02,
        0.03,
        0.031,
        0.04,
        0.05,
    ]
    assert lines[3].startswith("+0.010 s fault   ")
    assert "cuMemAlloc_v2 #3 fail: CUDA_ERROR_OUT_OF_MEMORY (2)" in lines[3]
    assert "unattributed: SIGCHLD (17)" in lines[2]
    assert "killed by SIGSEGV (11) (core dumped)" in out
    assert "ended: done (exit 139)" in lines[-1]


def test_latest_is_the_default(evidence: dict) -> None:
    assert gf("timeline", "--db", evidence["db"]) == gf(
        "timeline", evidence["run"], "--db", evidence["db"]
    )


def test_json_has_every_event_and_field(evidence: dict) -> None:
    rc, out = gf("timeline", evidence["run"], "--json", "--db", evidence["db"])
    doc = json.loads(out)
    assert rc == 0 and doc["runs"] == [evidence["run"]] and doc["notes"] == []
    assert len(doc["events"]) == 11
    fault = next(e for e in doc["events"] if e["kind"] == "fault")
    assert set(fault) == {
        "t_s",
        "kind",
        "run_id",
        "fault_id",
        "text",
        "wall",
        "ts_ns",
        "rule",
        "detail",
    }
    err = next(e for e in doc["events"] if e["kind"] == "error-return")
    assert err["rule"] == "same-thread-next-error" and err["detail"] == {"func": 0, "ret": 2}


def test_an_experiment_merges_its_steps_runs(evidence: dict) -> None:
    db = store.open_db(evidence["db"])
    with db.conn:
        db["experiments"].insert(
            {
                "id": "x0000beef",
                "name": "oom",
                "version": 1,
                "started_at": evidence["started"] - 1.0,
                "verdict": "pass",
            }
        )
        db["experiment_steps"].insert(
            {"experiment_id": "x0000beef", "idx": 0, "name": "oom", "run_id": evidence["run"]}
        )
    db.close()
    rc, out = gf("timeline", "x0000beef", "--db", evidence["db"])
    assert rc == 0, out
    assert out.splitlines()[0].startswith(f"timeline of experiment x0000beef {evidence['run']}")
    assert out.splitlines()[1].startswith("+1.000 s run")


def test_a_run_without_faults_times_from_its_first_event(tmp_path: Path) -> None:
    db = store.open_db(tmp_path / "gf.db")
    run = store.new_run(db, ["gpufault", "trace"], "trace", mechanism="bpf")
    with db.conn:
        db["links"].insert(
            {
                "run_id": run,
                "kind": "exit",
                "rule": "unattributed",
                "ts_ns": 5_000,
                "pid": 1,
                "tid": 1,
                "detail": json.dumps({"exit_status": 3, "term_signal": 0}),
            }
        )
    doc = tl.build(db, run)
    db.close()
    assert doc.notes and "no fault" in doc.notes[0]
    assert any(
        e.kind == "exit" and e.text.startswith("unattributed: exited with status 3")
        for e in doc.events
    )


def test_unknown_run_is_one_line_exit_2(evidence: dict) -> None:
    rc, out = gf("timeline", "deadbeef", "--db", evidence["db"])
    assert rc == 2 and out.count("\n") == 1 and "no run or experiment 'deadbeef'" in out


def test_a_layers_window_has_its_start_and_end(tmp_path: Path) -> None:
    from pyctl.evidence import layers

    db = store.open_db(tmp_path / "gf.db")
    run = store.new_run(db, ["gpufault", "hooks", "vram-pressure"], "hooks:vram-pressure")
    (started,) = db.conn.execute("SELECT started FROM runs").fetchone()
    row = layers.fault_row(
        run,
        1,
        action="pressure",
        function="vram",
        mechanism="vram-hold",
        outcome={"share": 0.5, "bytes_held": 1 << 30},
        wall=started + 1.0,
        latency_ns=2_000_000_000,
    )
    layers.insert_faults(db, [row])
    doc = tl.build(db, run)
    db.close()
    got = [(e.kind, round(e.t_s, 3)) for e in doc.events if e.kind in ("fault", "end")]
    assert got == [("fault", 1.0), ("end", 3.0)]
    fault = next(e for e in doc.events if e.kind == "fault")
    assert fault.text.startswith("vram #1 pressure via vram-hold: ") and "share=0.5" in fault.text


def test_whole_lines_off_a_terminal_80_columns_on_one(tmp_path: Path) -> None:
    """Issue 25 item 15, as `faults` and `show` do: into a pipe or a file
    every line whole (the run's command line here is 150 characters), on a
    terminal 80 columns, cut with a mark that says so."""
    import subprocess
    import sys

    from test_cli_output_limits import _on_a_terminal

    db = store.open_db(tmp_path / "gf.db")
    argv = ["gpufault", "trace", "--fn", "x" * 120, "--lib", "libgftarget"]
    run = store.new_run(db, argv, "trace", mechanism="bpf")
    db.close()
    args = ["timeline", run, "--db", str(tmp_path / "gf.db")]
    piped = subprocess.run([sys.executable, "-m", "pyctl", *args], capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert piped.returncode == 0, piped.stderr
    started = [ln for ln in piped.stdout.splitlines() if " started: " in ln]
    assert len(started) == 1 and started[0].endswith(" ".join(argv)), piped.stdout
    with open(tmp_path / "out.txt", "w") as f:
        subprocess.run([sys.executable, "-m", "pyctl", *args], stdout=f, timeout=60, check=True)
    assert (tmp_path / "out.txt").read_text() == piped.stdout
    tty = _on_a_terminal(*args).splitlines()
    assert tty and all(len(ln) <= 80 for ln in tty), tty
    assert any(" started: " in ln and ln.endswith("...") for ln in tty), tty
