"""gpufault evidence merge (pyctl/evidence/merge.py, gpufault.merge_evidence):
real runs' databases from two "nodes" merged into one store that `show`
reads exactly as each source; merging twice adds nothing; an id clash
with other contents is refused and leaves the destination as it was."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_root
from gftarget import LIB, Target

import gpufault
from gpufault import BadInput, Fault
from pyctl.evidence import schema

GF = [sys.executable, "-m", "pyctl"]
VICTIM = (str(LIB), "gf_victim")


def _counts(db: Path) -> dict[str, int]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        names = [t.name for t in schema.TABLES]
        return {n: con.execute(f'SELECT count(*) FROM "{n}"').fetchone()[0] for n in names}
    finally:
        con.close()


def _node(tmp: Path, name: str, ret: int) -> tuple[Path, str]:
    """A node's database: a fail (stack, registers, args, targets row) and
    a trace (call rows) on a real gf_target; returns it and the fault id."""
    db = tmp / f"{name}.db"
    t = Target()
    try:
        with gpufault.arm(Fault.fail(*VICTIM, ret=ret, nth=2), t.pid, db=db, duration=30) as s:
            assert [r[3] for r in t.victim(3)] == [2, ret, 4]
            assert s.wait_fires(1, 10)
        with gpufault.arm(Fault.trace(*VICTIM), t.pid, db=db, duration=30):
            t.victim(5)
        (f,) = s.faults()
        return db, f.fault_id
    finally:
        t.close()


def _show(db: Path, fault_id: str) -> str:
    r = subprocess.run([*GF, "show", fault_id, "--db", str(db)], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def _plant_experiment(db: Path, xid: str) -> None:
    con = sqlite3.connect(db)
    try:
        con.execute(
            "INSERT INTO experiments (id, name, version, verdict) VALUES (?, 'e', 1, 'pass')",
            (xid,),
        )
        con.execute("INSERT INTO probe_samples (experiment_id, probe, phase) VALUES (?, 'p', 'b')",
                    (xid,))  # fmt: skip
        con.commit()
    finally:
        con.close()


@requires_root
def test_two_nodes_merge_into_one_store_that_reads_like_each(tmp_path: Path) -> None:
    a, fa = _node(tmp_path, "node-a", -5)
    b, fb = _node(tmp_path, "node-b", -7)
    _plant_experiment(a, "x00000001")
    ca, cb = _counts(a), _counts(b)
    assert ca["calls"] >= 5 and ca["stacks"] > 0 and ca["targets"] == 2
    into = tmp_path / "fleet.db"
    r = subprocess.run([*GF, "evidence", "merge", str(a), str(b), "--into", str(into)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{a}: 2 runs, 1 experiments, 1 faults, ") and lines[1].startswith(
        f"{b}: 2 runs, 1 faults, "), r.stdout  # fmt: skip
    merged = _counts(into)
    assert merged == {k: ca[k] + cb[k] for k in ca}, (merged, ca, cb)
    # Each fault reads the same from the merged store as from its node's.
    assert _show(into, fa).replace(str(into), "DB") == _show(a, fa).replace(str(a), "DB")
    assert _show(into, fb).replace(str(into), "DB") == _show(b, fb).replace(str(b), "DB")
    assert os.stat(into).st_mode & 0o777 == 0o600
    # Twice: nothing new.
    out = gpufault.merge_evidence([a, b], into)
    assert [(s.runs_added, s.runs_skipped) for s in out] == [(0, 2), (0, 2)]
    assert out[0].experiments_skipped == 1
    assert _counts(into) == merged


@requires_root
def test_an_id_clash_with_other_contents_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    a, _ = _node(tmp_path, "node-a", -5)
    clash = tmp_path / "clash.db"
    shutil.copy(a, clash)
    con = sqlite3.connect(clash)
    con.execute("UPDATE runs SET host = 'another-host' WHERE rowid = 1")
    con.commit()
    con.close()
    into = tmp_path / "fleet.db"
    gpufault.merge_evidence([a], into)
    before = _counts(into)
    r = subprocess.run([*GF, "evidence", "merge", str(clash), "--into", str(into)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2, r
    (line,) = r.stderr.strip().splitlines()
    assert "is already in the destination with other contents" in line, line
    assert _counts(into) == before
    # A new destination that the refused merge created is not left behind.
    fresh = tmp_path / "fresh.db"
    with pytest.raises(BadInput, match="with other contents"):
        gpufault.merge_evidence([a, clash], fresh)
    assert not fresh.exists() and not Path(f"{fresh}-wal").exists()


@requires_root
def test_bad_sources_are_one_line(tmp_path: Path) -> None:
    a, _ = _node(tmp_path, "node-a", -5)
    for args, want in (
        ([str(a), "--into", str(a)], "is the destination itself"),
        ([str(tmp_path / "none.db"), "--into", str(tmp_path / "x.db")], "none.db"),
        (["--into", str(tmp_path / "x.db")], "give the databases to merge"),
    ):
        r = subprocess.run([*GF, "evidence", "merge", *args], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        assert r.returncode == 2 and want in r.stderr, r
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "x.db").exists()
    # Another user's file is not read (the store's reader checks).
    foreign = tmp_path / "foreign.db"
    shutil.copy(a, foreign)
    os.chown(foreign, 65534, 65534)
    r = subprocess.run([*GF, "evidence", "merge", str(foreign), "--into", str(tmp_path / "x.db")],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "foreign.db" in r.stderr, r
    assert not (tmp_path / "x.db").exists()
