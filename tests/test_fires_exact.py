"""Recorded fires equal what the target saw, through the real controller
loop (`gpufault inject`), at 1, 8 and 64 threads: the target counts on its
own side every call whose result was changed, and the database must hold
exactly those fires, with the skipped ones (no room for their evidence
record: the call ran unchanged) counted in the run row."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from gftarget import LIB, TARGET, Target, on_victim
from procio import finish, start_controller

pytestmark = [pytest.mark.root]
REPO = Path(__file__).resolve().parent.parent

if not TARGET.exists():  # pragma: no cover
    pytest.skip("build/targets/gf_target missing: run make build", allow_module_level=True)


def _controller(pid: int, db: Path, ring: int | None) -> subprocess.Popen[str]:
    env = dict(os.environ)
    if ring:
        env["GPUFAULT_FIRES_RING_BYTES"] = str(ring)
    ctl, _ = start_controller(
        [
            sys.executable,
            "-m",
            "pyctl",
            *on_victim("inject", pid),
            "--action",
            "fail",
            "--ret",
            "-7",
            "--every",
            "2",
            "--no-stack",
            "--db",
            str(db),
        ],
        env=env,
        cwd=REPO,
    )
    return ctl


@pytest.mark.parametrize("threads", [1, 8, 64])
@pytest.mark.parametrize("ring", [None, 16384], ids=["default-ring", "16KiB-ring"])
def test_cli_records_exactly_the_failures_the_target_saw(
    tmp_path: Path, threads: int, ring: int | None
) -> None:
    t = Target()
    db = tmp_path / "gf.db"
    calls = 8192
    try:
        ctl = _controller(t.pid, db, ring)
        rows = t.victim(calls // threads, threads=threads)
        ctl.send_signal(signal.SIGINT)
        _, err = finish(ctl, 60)
    finally:
        t.close()
    assert ctl.returncode == 0, err
    failed = sum(1 for r in rows if r[3] == -7)
    con = sqlite3.connect(db)
    injected = 0
    for (outcome,) in con.execute("SELECT outcome FROM faults"):
        o = json.loads(outcome) if outcome else {}
        if o.get("injected") is not False and not (o.get("copilot") or {}).get("error"):
            injected += 1
    (stats,) = con.execute("SELECT stats FROM runs").fetchone()
    st = json.loads(stats)
    skipped = st.get("fires_skipped", 0)
    print(
        f"\n{threads} threads, ring {ring or 'default'}: target saw {failed} failures, "
        f"{injected} recorded injected, {skipped} skipped"
    )
    assert failed == injected
    assert failed + skipped == calls // 2  # every selected call fired or was skipped
    if skipped:
        assert f"{skipped} fires skipped" in err
    # Every stored batch became rows before the run ended.
    assert con.execute("SELECT count(*) FROM fire_journal").fetchone()[0] == 0


def test_a_burst_is_stored_raw_then_becomes_rows(tmp_path: Path) -> None:
    """Stage 1 takes the fires ring into fire_journal in whole batches
    (this is what keeps fires from being skipped); stage 2 turns them into
    rows when there is time, each batch's rows and its deletion together.
    With no time to spare the journal holds the burst; a drain without a
    budget (as at the end of a run) leaves it empty and every fire a row,
    with its return value merged although the call record came first."""
    from pyctl.engine import Engine
    from pyctl.spec import FaultSpec

    t = Target()
    db = tmp_path / "gf.db"
    spec = FaultSpec(
        lib=str(LIB),
        fn="gf_victim",
        action="fail",
        ret=-7,
        every=1,
        capture_stack=False,
        tgid=t.pid,
    )
    eng = Engine([spec], db_path=db, pid=t.pid, argv=["test"])
    eng.start()
    try:
        rows = t.victim(3000)
        eng.drain(budget_s=0)  # one batch of rows at most
        con = sqlite3.connect(db)
        stored = con.execute("SELECT coalesce(sum(n), 0) FROM fire_journal").fetchone()[0]
        made = con.execute("SELECT count(*) FROM faults").fetchone()[0]
        assert made <= 512 and stored + made == 3000, (stored, made)
        eng.drain()
        assert con.execute("SELECT count(*) FROM fire_journal").fetchone()[0] == 0
    finally:
        eng.close()
        t.close()
    assert sum(1 for r in rows if r[3] == -7) == 3000
    faults = con.execute("SELECT count(*), count(ret), min(ret), max(ret) FROM faults").fetchone()
    assert faults == (3000, 3000, -7, -7), faults
