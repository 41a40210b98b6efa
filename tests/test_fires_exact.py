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
from gftarget import LIB, TARGET, Target

pytestmark = [pytest.mark.root]
REPO = Path(__file__).resolve().parent.parent

if not TARGET.exists():  # pragma: no cover
    pytest.skip("build/targets/gf_target missing: run make build", allow_module_level=True)


def _controller(pid: int, db: Path, ring: int | None) -> subprocess.Popen[str]:
    env = dict(os.environ)
    if ring:
        env["GPUFAULT_FIRES_RING_BYTES"] = str(ring)
    ctl = subprocess.Popen(
        [sys.executable, "-m", "pyctl", "inject", "--pid", str(pid), "--lib", str(LIB),
         "--fn", "gf_victim", "--action", "fail", "--ret", "-7", "--every", "2", "--no-stack",
         "--db", str(db)], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    assert ctl.stderr is not None
    while "Ctrl-C to end" not in (ln := ctl.stderr.readline()):
        assert ln, "controller exited early"
    return ctl


@pytest.mark.parametrize("threads", [1, 8, 64])
@pytest.mark.parametrize("ring", [None, 16384], ids=["default-ring", "16KiB-ring"])
def test_cli_records_exactly_the_failures_the_target_saw(tmp_path: Path, threads: int,
                                                         ring: int | None) -> None:
    t = Target()
    db = tmp_path / "gf.db"
    calls = 8192
    try:
        ctl = _controller(t.pid, db, ring)
        rows = t.victim(calls // threads, threads=threads)
        ctl.send_signal(signal.SIGINT)
        _, err = ctl.communicate(timeout=60)
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
    print(f"\n{threads} threads, ring {ring or 'default'}: target saw {failed} failures, "
          f"{injected} recorded injected, {skipped} skipped")
    assert failed == injected
    assert failed + skipped == calls // 2  # every selected call fired or was skipped
    if skipped:
        assert f"{skipped} fires skipped" in err
