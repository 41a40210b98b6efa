"""Paths are stored canonical (every link and ./.. resolved), as the
kernel's maps name them, never as typed (`./build/targets/x`): funcs and
faults rows, and whether the target has the file mapped."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from gftarget import LIB, REPO, Target

from pyctl.engine import Engine
from pyctl.spec import FaultSpec
from pyctl.symbols import resolve

TYPED = "./build/targets/libgftarget.so"


def test_a_typed_path_and_a_symlink_resolve_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not LIB.exists():  # pragma: no cover - make build makes it
        pytest.skip("build/targets/libgftarget.so missing: run make build")
    monkeypatch.chdir(REPO)
    real = os.path.realpath(LIB)
    assert resolve.find_library(TYPED).display == real
    link = tmp_path / "libalias.so"
    link.symlink_to(LIB)
    assert resolve.find_library(str(link)).display == real
    assert resolve.find_library(f"{tmp_path}/../{tmp_path.name}/libalias.so").display == real


def test_the_root_of_another_process_is_taken_off() -> None:
    got = resolve.canonical_path("/proc/self/root/usr/lib/../lib", "/proc/self/root")
    assert got == os.path.realpath("/usr/lib")


@pytest.mark.root
def test_rows_hold_the_canonical_path_of_a_typed_one(
    target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    # Mapped by the target: typed relative, it is still the file it maps.
    assert resolve.find_library(TYPED, target.pid).mapped
    db = tmp_path / "gf.db"
    s = FaultSpec(lib=TYPED, fn="gf_victim", action="fail", ret=-5, nth=1, tgid=target.pid)
    eng = Engine([s], db_path=db, pid=target.pid, argv=["test"])
    eng.start()
    try:
        target.victim(2)
        eng.drain()
    finally:
        eng.close()
    assert not eng.start_warnings  # no "not loaded in pid ... yet"
    con = sqlite3.connect(db)
    real = os.path.realpath(LIB)
    assert con.execute("SELECT DISTINCT library FROM funcs").fetchall() == [(real,)]
    assert con.execute("SELECT library FROM faults").fetchall() == [(real,)]
