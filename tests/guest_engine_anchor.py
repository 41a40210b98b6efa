#!/usr/bin/env python3
"""Runs inside the bookworm VM (tests/test_engine_anchors_vm.py): gpufa.ko
watching QEMU's edu device, a gpufault fault fired in a real process, then an
anchor: the anchor record must carry that fault's ID and show up in
`gpufault show`'s chain. Writes facts to OUTDIR/result.json."""

from __future__ import annotations

import glob
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gftarget import LIB, Target  # noqa: E402

from pyctl.anchors.device import AnchorDevice  # noqa: E402
from pyctl.anchors.modload import insmod, rmmod  # noqa: E402
from pyctl.engine import Engine  # noqa: E402
from pyctl.evidence import (
    query,  # noqa: E402
    store,
)
from pyctl.spec import FaultSpec  # noqa: E402

ko, outdir = sys.argv[1], Path(sys.argv[2])
res: dict = {}
try:
    bdf = next(
        os.path.basename(d)
        for d in glob.glob("/sys/bus/pci/devices/*")
        if Path(d, "vendor").read_text().strip() == "0x1234"
        and Path(d, "device").read_text().strip() == "0x11e8"
    )
    insmod(ko, f"devices={bdf} bar0=0x0,0x4 watchdog_ms=100")
    t = Target()
    # The guest's tmpfs (SQLite WAL needs shared mmap), in a directory of
    # root's alone: a writer refuses a sticky /tmp (pyctl/evidence/dbfile.py).
    os.makedirs("/tmp/gf", mode=0o700, exist_ok=True)
    db_path = "/tmp/gf/gf.db"
    eng = Engine(
        [FaultSpec(lib=str(LIB), fn="gf_victim", action="signal", signo=28, nth=1, tgid=t.pid)],
        db_path=db_path,
        pid=t.pid,
        argv=["vm-anchor"],
    )
    eng.start()
    t.victim(1)
    eng.drain()  # reads the fire: sets the module's fault context
    with AnchorDevice() as qa:
        qa.fire(bdf, 7)
    for _ in range(50):
        eng.poll(0.1)
        if eng.db.conn.execute("SELECT count(*) FROM anchors").fetchone()[0]:
            break
    fid = eng.db.conn.execute("SELECT fault_id FROM faults").fetchone()[0]
    eng.close()
    t.close()
    db = store.open_db(db_path)
    chain = query.fault_chain(db, fid)
    assert chain is not None
    res = {
        "fault_id": fid,
        "anchors": [
            {k: a[k] for k in ("fault_id", "kind", "bdf") if k in a} for a in chain["anchors"]
        ],
        "bar0_0": [a.get("bar0") for a in chain["anchors"]][:1],
    }
    rmmod("gpufa")
except Exception:  # noqa: BLE001 - reported to pytest
    res["error"] = traceback.format_exc()
(outdir / "result.json").write_text(json.dumps(res, default=str))
