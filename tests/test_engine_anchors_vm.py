"""The engine and gpufa.ko together, in qemu on bookworm's 6.1 kernel: a
fault fired by gpufault sets the module's fault context, so the next anchor
(a manual fire on QEMU's edu device) carries the fault's ID, is stored by
the engine, and appears in the fault's chain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "vm"))

import vmrun  # noqa: E402

pytestmark = [pytest.mark.vm, pytest.mark.root]


def test_anchor_carries_the_fault_id(tmp_path: Path, vm_guest: Any) -> None:
    why = vmrun.kernel_available("bookworm")
    if why:
        pytest.skip(why)
    kdir_file = REPO / "build" / "vm" / "bookworm" / "kdir"
    if not kdir_file.exists():
        pytest.skip("bookworm headers not fetched: make vm-kernels")
    out = REPO / "build" / "kmod" / "engine-vm"
    proc = subprocess.run(
        ["make", "-C", str(REPO / "kmod"), f"KDIR={kdir_file.read_text().strip()}", f"OUT={out}"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The session's bookworm guest (conftest.vm_guest), edu included.
    res = vm_guest("bookworm").run(
        ["python3", "tests/guest_engine_anchor.py", str(out / "gpufa.ko"), str(tmp_path)],
        cwd=REPO,
        rw=[tmp_path],
        timeout=300,
    )
    r = json.loads((tmp_path / "result.json").read_text())
    assert "error" not in r, r["error"]
    assert r["anchors"], r
    assert {a["fault_id"] for a in r["anchors"]} == {r["fault_id"]}
    assert not res.splats, res.splats
