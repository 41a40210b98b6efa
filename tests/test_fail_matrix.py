"""`fail` and `corrupt` on every kernel: the same file runs on the host
(6.18: the verifier refuses register writes, lockdown refuses user-memory
writes, so the ptrace copilot finishes them) and inside qemu on Debian sid's
7.2 kernel (register writes allowed: the regs mechanism, no stop).
GF_EXPECT_MECH (set by tests/test_vm_matrix.py) says which one must be used;
without it the test asserts the mechanism the trial load detected.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from gftarget import LIB, TARGET, Target

from pyctl.bpf import abi
from pyctl.capabilities import regs_writable, uprobe_multi, user_writable
from pyctl.engine import Engine
from pyctl.spec import FaultSpec

pytestmark = [pytest.mark.root]

if not TARGET.exists():  # pragma: no cover
    pytest.skip("build/targets/gf_target missing: run make build", allow_module_level=True)

EXPECT = os.environ.get("GF_EXPECT_MECH") or ("regs" if regs_writable() else "copilot")
# A fail-skip where BPF cannot write registers goes through the signal
# helper by default (docs/copilot.md, "Which mechanism a run gets"); a fail
# after the body, or a run that asks for the copilot, stays on the copilot.
EXPECT_SKIP = "signal" if EXPECT == "copilot" else EXPECT
# Whether the engine's programs (the regs pair included) go in uprobe_multi
# links; the VM matrix says what each kernel must do.
EXPECT_MULTI = os.environ.get("GF_EXPECT_MULTI", "1" if uprobe_multi() else "0") == "1"


def run(db: Path, t: Target, spec: FaultSpec, mechanism: str = "auto") -> Engine:
    spec.tgid = t.pid
    eng = Engine([spec], db_path=db, pid=t.pid, argv=["matrix"], mechanism=mechanism)
    eng.start()
    return eng


def mechanisms(db: Path) -> set[str]:
    con = sqlite3.connect(db)
    try:
        return {m for (m,) in con.execute("SELECT mechanism FROM faults")}
    finally:
        con.close()


def test_detected_mechanism_is_the_expected_one() -> None:
    assert ("regs" if regs_writable() else "copilot") == EXPECT


@pytest.mark.parametrize("mechanism", ["auto", "copilot"])
@pytest.mark.parametrize("mode", ["skip", "after"])
def test_fail_modes(target: Target, tmp_db: Path, mode: str, mechanism: str) -> None:
    eng = run(
        tmp_db,
        target,
        FaultSpec(lib=str(LIB), fn="gf_victim", action="fail", ret=-5, mode=mode, nth=2),
        mechanism,
    )
    expect = EXPECT_SKIP if mode == "skip" and mechanism == "auto" else EXPECT
    try:
        rows = target.victim(4)
        eng.drain()
        assert eng.mechanism == expect
        assert eng.multi is EXPECT_MULTI
    finally:
        eng.close()
    assert [r[3] for r in rows] == [2, -5, 4, 5]
    assert [r[4] for r in rows] == ([2, -1, 6, 8] if mode == "skip" else [2, 4, 6, 8])
    assert mechanisms(tmp_db) == {expect}


def test_sticky_with_8_threads(target: Target, tmp_db: Path) -> None:
    eng = run(
        tmp_db,
        target,
        FaultSpec(lib=str(LIB), fn="gf_victim", action="fail", ret=-9, after=100, sticky=True),
    )
    try:
        rows = target.victim(50, threads=8)
        eng.drain()
        c = eng.counters()[0]
    finally:
        eng.close()
    failed = [r for r in rows if r[3] == -9]
    ok = [r for r in rows if r[3] == r[2] + 1]
    assert len(failed) + len(ok) == 400
    # Calls 1..100 pass; the 101st fires and every later one fails (sticky).
    assert len(ok) == 100 and len(failed) == 300 and c.fires == 300
    assert all(r[4] == -1 for r in failed)  # skip: no body ran
    assert mechanisms(tmp_db) == {EXPECT_SKIP}


def test_corrupt_mechanism(target: Target, tmp_db: Path) -> None:
    eng = run(
        tmp_db,
        target,
        FaultSpec(
            lib=str(LIB),
            fn="gf_alloc",
            action="corrupt",
            corrupt=(1, 0, abi.CORRUPT_OPS["set"], 0xDEAD, 8),
            nth=1,
        ),
    )
    try:
        got = target.alloc(2)
        eng.drain()
    finally:
        eng.close()
    assert got == [(1, 0, 0xDEAD), (2, 0, 0x102000)]
    assert mechanisms(tmp_db) == {"bpf" if user_writable() else "copilot"}


def _injected(db: Path) -> int:
    """Fault rows whose injection happened (a copilot fire the copilot never
    carried out is marked so, never counted as injected)."""
    import json

    con = sqlite3.connect(db)
    try:
        n = 0
        for mech, outcome in con.execute("SELECT mechanism, outcome FROM faults"):
            o = json.loads(outcome) if outcome else {}
            if o.get("injected") is False:
                continue
            if mech == "copilot" and (o.get("copilot") or {}).get("error"):
                continue
            n += 1
        return n
    finally:
        con.close()


@pytest.mark.parametrize("threads", [1, 8, 64])
def test_recorded_fires_equal_what_the_target_saw(
    target: Target, tmp_db: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every second call fails, from 1, 8 and 64 threads, with a fires ring
    of 16 KiB (~30 records) so that it fills: a fire that cannot reserve
    its record does not happen (skipped, counted), so the failures the
    target saw equal the recorded injected fires exactly, and every
    selected call is either fired or skipped."""
    from pyctl import engine as engine_mod

    monkeypatch.setattr(engine_mod, "FIRES_RING_BYTES", 16384)
    calls = 4096
    eng = run(
        tmp_db,
        target,
        FaultSpec(
            lib=str(LIB), fn="gf_victim", action="fail", ret=-7, every=2, capture_stack=False
        ),
    )
    try:
        rows = target.victim(calls // threads, threads=threads)
        eng.drain()
        c = eng.counters()[0]
        lost = eng.lost()
    finally:
        eng.close()
    failed = sum(1 for r in rows if r[3] == -7)
    ok = sum(1 for r in rows if r[3] == r[2] + 1)
    assert failed + ok == calls == c.calls
    recorded = _injected(tmp_db)
    print(
        f"\n{threads} threads: target saw {failed} failures, {recorded} recorded, "
        f"{lost['fires_skipped']} skipped, mechanism {EXPECT}"
    )
    assert failed == recorded == c.fires
    assert c.fires + lost["fires_skipped"] == calls // 2
    assert lost["fires_lost"] == 0
