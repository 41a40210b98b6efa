#!/usr/bin/env python3
"""The AER anchor check inside the test VM (tests/test_kmod_aer.py).

Watches the first PCI device with the given vendor:device (a PCIe device
with an AER capability below a root port), sets a fault context, prints the
marker on which the host injects an AER error through the QEMU monitor, and
writes the record it got to OUTDIR/aer.json.

usage: guest_aer.py KO OUTDIR VENDOR:DEVICE MARKER
"""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

from pyctl.anchors import AnchorDevice
from pyctl.anchors.modload import insmod, rmmod


def find(ids: str) -> str:
    vendor, device = (f"0x{x}" for x in ids.split(":"))
    for d in sorted(glob.glob("/sys/bus/pci/devices/*")):
        if (Path(d, "vendor").read_text().strip(), Path(d, "device").read_text().strip()) == (
            vendor,
            device,
        ):
            return os.path.basename(d)
    raise SystemExit(f"no PCI device {ids} in the guest")


def main() -> int:
    ko, outdir, ids, marker = sys.argv[1:5]
    bdf = find(ids)
    insmod(ko, f"devices={bdf} watchdog_ms=0")
    with AnchorDevice() as dev:
        stats = dev.stats()
        dev.set_context("0000a0e1-5", pid=1234)
        print(marker, flush=True)  # the host injects the error now
        recs = dev.read_until(1, timeout=60)
    rmmod("gpufa")
    out = {
        "bdf": bdf,
        "stats": stats,
        "records": [
            {
                "kind": r.kind,
                "fault_id": r.fault_id,
                "bdf": r.bdf,
                "code": r.code & 0xFFFFFFFF,
                "aer_pos": r.aer_pos,
                "aer": r.aer,
                "devsta": r.devsta,
                "config_ok": r.config_ok,
                "comm": r.comm,
            }
            for r in recs
        ],
    }
    Path(outdir, "aer.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
