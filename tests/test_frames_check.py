"""The session's frames check (tests/frames_check.py) fails on a planted
bad frame and passes on good ones: databases planted outside the
session's basetemp (the session's own check must not see them)."""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path

import frames_check as fc
import pytest

from pyctl import elf
from pyctl.evidence import schema


@pytest.fixture
def tree() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gf-frames-check-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _module() -> tuple[str, str, int, int]:
    """(path, build-id, an offset in an executable PT_LOAD, one in none)."""
    path = os.path.realpath(shutil.which("true") or "/bin/true")
    with elf.ElfFile.open(path) as f:
        x = [s for s in f.loads if s.flags & fc.PF_X]
        covered = [(s.vaddr, s.vaddr + s.memsz) for s in x]
        top = max(s.vaddr + s.memsz for s in f.loads)
        outside = next(v for v in (0, top + 0x1000) if not any(lo <= v < hi for lo, hi in covered))
        return path, f.build_id, x[0].vaddr + 4 - f.first_load, outside - f.first_load


def _plant(path: Path, frames: list[tuple[object, ...]]) -> None:
    """A gpufault database with one fault and these (module, offset,
    build_id, method) frames."""
    c = sqlite3.connect(path)
    schema.ensure_schema(c)
    c.execute("INSERT INTO runs (run_id) VALUES ('0badf00d')")
    c.execute("INSERT INTO faults (fault_id, run_id, seq) VALUES ('0badf00d-1', '0badf00d', 1)")
    for depth, (module, off, bid, method) in enumerate(frames):
        c.execute(
            "INSERT INTO stacks (fault_id, depth, address, symbol, module, offset, build_id, "
            "method) VALUES ('0badf00d-1', ?, ?, 'x', ?, ?, ?, ?)",
            (depth, 0x5555_0000_0000 + depth, module, off, bid, method),
        )
    c.commit()
    c.close()


def test_good_frames_pass(tree: Path) -> None:
    path, bid, inside, _outside = _module()
    _plant(tree / "a.db", [(path, inside, bid, "ip"), (path, inside + 8, bid, "cfi")])
    # A module that is gone is checked for its shape only.
    _plant(tree / "b.db", [("/nonexistent/libgone.so", 0x1234, "ab" * 20, "fp")])
    (tree / "other.db").write_bytes(b"")
    sqlite3.connect(tree / "other.db").execute("CREATE TABLE t (x)").connection.commit()
    r = fc.check_tree(tree)
    assert (r.dbs, r.frames, r.in_segment, r.shape_only, r.bad) == (2, 3, 2, 1, [])
    failed, lines = fc.verdict(r, "auto", True)
    assert not failed and "3 native frames in 2 gpufault databases" in lines[0]


def test_each_kind_of_bad_frame_fails(tree: Path) -> None:
    path, bid, inside, outside = _module()
    _plant(
        tree / "bad.db",
        [
            (path, inside, bid, "ip"),  # good
            (None, None, None, "fp"),  # a bare address
            (path, inside, bid, "guess"),  # unknown method
            (path, outside, bid, "cfi"),  # no executable segment holds it
            (path, outside, "00" * 20, "cfi"),  # rebuilt since: shape only
        ],
    )
    r = fc.check_tree(tree)
    assert r.frames == 5 and r.in_segment == 1 and r.shape_only == 1
    assert [(b.db, b.fault_id, b.depth) for b in r.bad] == [
        ("bad.db", "0badf00d-1", 1),
        ("bad.db", "0badf00d-1", 2),
        ("bad.db", "0badf00d-1", 3),
    ]
    assert "bare address" in r.bad[0].why and "'guess'" in r.bad[1].why
    assert "no executable PT_LOAD" in r.bad[2].why
    failed, lines = fc.verdict(r, "auto", False)
    assert failed and any("bad.db 0badf00d-1 #3" in line for line in lines)
    assert not fc.verdict(r, "warn", False)[0]


def test_a_frame_without_a_method_warns_unless_required(tree: Path) -> None:
    _plant(tree / "planted.db", [(None, None, None, None)])
    r = fc.check_tree(tree)
    assert len(r.bad) == 1
    failed, lines = fc.verdict(r, "auto", True)
    assert not failed and any("WARNING" in line for line in lines)
    assert fc.verdict(r, "require", False)[0]


def test_no_frame_fails_only_when_frames_were_due(tree: Path) -> None:
    r = fc.check_tree(tree)
    assert r.frames == 0
    assert not fc.verdict(r, "auto", False)[0]  # a few tests that store no stacks
    assert fc.verdict(r, "auto", True)[0]  # a stack test passed: the check looked in vain
    assert fc.verdict(r, "require", False)[0]


def test_a_wal_is_read_and_nothing_is_created_beside_the_file(tree: Path) -> None:
    path, bid, inside, outside = _module()
    db = tree / "wal.db"
    _plant(db, [])
    keep = sqlite3.connect(db)  # held open: its WAL is not checkpointed away
    keep.execute("PRAGMA journal_mode=WAL")
    keep.execute("PRAGMA wal_autocheckpoint=0")
    keep.execute(
        "INSERT INTO stacks (fault_id, depth, address, module, offset, build_id, method) "
        "VALUES ('0badf00d-1', 0, 1, ?, ?, ?, 'cfi')",
        (path, outside, bid),
    )
    keep.commit()
    before = sorted(p.name for p in tree.iterdir())
    assert "wal.db-wal" in before
    r = fc.check_tree(tree)
    assert sorted(p.name for p in tree.iterdir()) == before
    keep.close()
    assert r.frames == 1 and len(r.bad) == 1
    # Closed: checkpointed, no -wal; read immutable, still nothing beside it.
    before = sorted(p.name for p in tree.iterdir())
    assert "wal.db-wal" not in before
    assert len(fc.check_tree(tree).bad) == 1
    assert sorted(p.name for p in tree.iterdir()) == before


def test_unknown_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fc.ENV, "strict")
    with pytest.raises(ValueError, match="expected one of auto, require, warn, off"):
        fc.mode()
