"""The pressure step (class 2, pressure mode): a second process holds GPU
memory for the step's duration (pyctl/experiment/steps/pressure.py).

Here there is no GPU, so the child runs with `allocator = "host-double"`
(pyctl/hooks/vram_pressure.py's HostMemoryDouble: host memory and a
made-up device size, a TEST DOUBLE of the GPU's memory and NVML). What is
checked is the step's life: armed once the child holds, its evidence
(the hooks' run and fault rows), released at the step's end, refused in
one line when the child cannot hold, nothing left running. The effect on
a real service needs the GPU host: docs/gpu-validation.md.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import pytest
from conftest import ID_ENV
from test_experiment_run import run_exp

from pyctl.experiment import load as F
from pyctl.experiment import model as M

REPO = Path(__file__).resolve().parent.parent

EXP = """\
name = "pressure-smoke"
version = 1
title = "a pressure step against the CPU service (host-double allocator)"
description = "the step's life only: the CPU service does not feel it"
slo_id = "t"

[target]
service = {{ device = "cpu", args = ["--batch-wait", "0"] }}

[load]
rate = 10.0
prompt = "hello"
max_tokens = 2
timeout = "2s"

[phases]
baseline = "2s"
recovery = "2s"

[steady_state]
error_rate = "<= 1%"

[[method]]
pressure = {{ share = 0.5, allocator = "{allocator}" }}
duration = "2s"
"""


def _pressure_children() -> list[int]:
    """This session's vram_pressure processes still running (none once a
    step ended). Ours by the session id each inherits (GPUFAULT_TEST_ID,
    conftest), so that another worker's or another session's step is not
    counted, while one of ours that outlived its step and was reparented is."""
    out = subprocess.run(["pgrep", "-f", "pyctl.hooks.vram_pressure"], capture_output=True,
                         text=True).stdout.split()  # fmt: skip
    mine = f"{ID_ENV}={os.environ[ID_ENV]}".encode()
    ours = []
    for p in out:
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if mine in env:
            ours.append(int(p))
    return ours


def test_a_pressure_step_holds_records_and_releases(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text(EXP.format(allocator="host-double"))
    db = tmp_path / "gf.db"
    rc, out, _t = run_exp(str(f), "--db", str(db))
    assert rc == 0 and "verdict PASS" in out, out
    assert "holding 0.1 GiB of GPU 0" in out, out  # share 0.5 of the double's 256 MiB
    with closing(sqlite3.connect(db)) as c:
        ((status, fires, run_id, spec),) = c.execute(
            "SELECT status, fires, run_id, spec FROM experiment_steps"
        ).fetchall()
        assert status == "done" and fires == 1, (status, fires)
        assert json.loads(spec)["pressure"]["share"] == 0.5
        ((kind, mech, rstatus),) = c.execute(
            "SELECT kind, mechanism, status FROM runs WHERE run_id=?", (run_id,)
        ).fetchall()
        assert (kind, mech, rstatus) == ("hooks:vram-pressure", "vram-hold", "done")
        ((action, outcome, latency_ns),) = c.execute(
            "SELECT action, outcome, latency_ns FROM faults WHERE run_id=?", (run_id,)
        ).fetchall()
    o = json.loads(outcome)
    assert action == "pressure" and o["bytes_held"] == 128 << 20 and o["readings"] == "test double"
    # Released by the step's end (SIGTERM) or the child's own deadline, a little later.
    assert o["reason"] in ("deadline", "signal:SIGTERM"), o
    assert 1.5e9 < latency_ns < 6e9, latency_ns
    assert not _pressure_children(), "the pressure child outlived its step"


def test_a_child_that_cannot_hold_is_one_line_and_an_error(tmp_path: Path) -> None:
    # torch without a GPU: vram_pressure refuses (exit 2); the step says why.
    f = tmp_path / "p.toml"
    f.write_text(EXP.format(allocator="torch"))
    db = tmp_path / "gf.db"
    rc, out, _t = run_exp(str(f), "--db", str(db))
    assert rc == 2 and "verdict ERROR" in out, out
    assert "vram pressure did not hold memory" in out and "vram_pressure:" in out, out
    assert not _pressure_children()


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ("{ share = 0 }", "pressure.share"),
        ("{ share = 1.5 }", "pressure.share"),
        ('{ share = "half" }', "pressure.share"),
        ('{ share = 0.5, allocator = "malloc" }', "pressure.allocator"),
        ("{ share = 0.5, gpu = 1 }", "pressure"),
        ("0.5", "pressure"),
    ],
)
def test_bad_pressure_tables_are_one_line(tmp_path: Path, table: str, needle: str) -> None:
    f = tmp_path / "p.toml"
    f.write_text(EXP.format(allocator="host-double").replace(
        '{ share = 0.5, allocator = "host-double" }', table))  # fmt: skip
    with pytest.raises(M.ExperimentError) as ei:
        F.load(str(f))
    msg = str(ei.value)
    assert "\n" not in msg and f"method[1].{needle}" in msg, msg


def test_a_pressure_step_takes_no_thread(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text(EXP.format(allocator="host-double").replace('duration = "2s"',
                 'duration = "2s"\nthread = "gf-worker"'))  # fmt: skip
    with pytest.raises(M.ExperimentError, match=r"method\[1\]\.thread: a pressure step"):
        F.load(str(f))
