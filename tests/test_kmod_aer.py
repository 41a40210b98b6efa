"""The AER anchor: the kernel's AER driver reports an error on a watched
device and gpufa records it with the AER registers.

Needs PCIe: a q35 machine, a root port, and below it a device with an AER
capability (QEMU's virtio-rng-pci with aer=on). vm/vmrun.py has no option
for extra devices yet, so this test wraps its qemu_argv to append them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "vm"))
try:
    import vmrun  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
    vmrun = None

pytestmark = [pytest.mark.vm, pytest.mark.slow]

OUT = REPO / "build" / "kmod" / "vm-out" / "6.1"
MARK = "GPUFA-AER-INJECT-NOW"
PCIE = [
    "-machine", "q35",
    "-device", "pcie-root-port,id=gfrp1,chassis=2,bus=pcie.0,addr=0x5",
    "-device", "virtio-rng-pci,id=gfaer0,bus=gfrp1,aer=on,disable-legacy=on",
]  # fmt: skip
UNSUP_REQ = 1 << 20  # PCI_ERR_UNC_UNSUP


@pytest.fixture(scope="module")
def aer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if vmrun is None:
        pytest.skip("vm/vmrun.py not importable")
    why = vmrun.kernel_available("bookworm")
    if why:
        pytest.skip(why)
    kdir = (REPO / "build" / "vm" / "bookworm" / "kdir").read_text().strip()
    proc = subprocess.run(
        ["make", "-C", str(REPO / "kmod"), f"KDIR={kdir}", f"OUT={OUT}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    share = tmp_path_factory.mktemp("kmod-aer")
    orig = vmrun.qemu_argv
    mp = pytest.MonkeyPatch()
    mp.setattr(vmrun, "qemu_argv", lambda *a, **k: orig(*a, **k) + PCIE)
    try:
        res = vmrun.run_in_vm(
            "bookworm",
            ["python3", "kmod/tests/guest_aer.py", str(OUT / "gpufa.ko"), str(share),
             "1af4:1044", MARK],
            cwd=REPO, rw=[share], qmp_on=[(MARK, "pcie_aer_inject_error gfaer0 UNSUP")],
            timeout=300,
        )  # fmt: skip
    finally:
        mp.undo()
    f = share / "aer.json"
    assert f.exists(), f"guest wrote no result (rc {res.rc}, {res.error}):\n{res.console[-4000:]}"
    return {"res": res, "r": json.loads(f.read_text())}


def test_aer_vm_clean(aer: dict[str, Any]) -> None:
    res = aer["res"]
    assert res.rc == 0, (res.error, res.output[-2000:])
    assert res.splats == []
    assert MARK in res.fired
    # The kernel's own AER report is there: the error really went through it.
    log = getattr(res, "dmesg", "") or res.console
    assert "AER: Uncorrected (Non-Fatal) error message received" in log


def test_aer_record(aer: dict[str, Any]) -> None:
    r = aer["r"]
    assert r["stats"]["aer_hooked"] == 1
    (rec,) = r["records"]
    assert rec["kind"] == "aer"
    assert rec["bdf"] == r["bdf"]
    assert rec["fault_id"] == "0000a0e1-5"  # the active fault context
    assert rec["code"] == UNSUP_REQ  # the unmasked status the kernel reported
    assert rec["aer_pos"] >= 0x100
    assert rec["aer"]["uncor_status"] & UNSUP_REQ
    assert rec["devsta"] is not None and rec["devsta"] & 0x8  # PCI_EXP_DEVSTA_URD
