"""--lib NAME in a process that maps two different files of that name
(seen: a CUDA build of torch's real libcublas.so.13 beside the libcublas
TEST DOUBLE of the same soname) is refused in one line naming both, not
resolved to whichever the maps list first; a path picks one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gftarget import LIB

from pyctl.symbols import resolve


def test_two_files_of_one_name_are_refused_and_a_path_picks_one(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        shutil.copy(LIB, d / "libgfdup.so.1")
    code = (
        "import ctypes, sys\n"
        "for p in sys.argv[1:]: ctypes.CDLL(p)\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-I", "-c", code, str(a / "libgfdup.so.1"), str(b / "libgfdup.so.1")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        with pytest.raises(resolve.ResolveError) as ei:
            resolve.find_library("libgfdup", p.pid)
        msg = str(ei.value)
        assert "\n" not in msg and "maps 2 libraries of that name" in msg, msg
        assert str(a / "libgfdup.so.1") in msg and str(b / "libgfdup.so.1") in msg
        lib = resolve.find_library(str(b / "libgfdup.so.1"), p.pid)
        assert lib.path.endswith("b/libgfdup.so.1"), lib
    finally:
        p.kill()
        p.wait()
