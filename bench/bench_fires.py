"""How fast the controller turns fires into evidence rows, per mechanism.

A fault fires only when its evidence record fits in the fires ring (else
it is skipped and counted: bpf/gpufault.bpf.c reserve_fire), so the ingest
rate decides how long a burst of fires can last before fires are skipped.
Here the target makes N calls that all fail (`--every 1`) while the
controller does not read; then the N records are read out of the ring
into the fire_journal table (stage 1: stored fires/s, what decides whether
fires are skipped), then turned into rows (stage 2, done when the rings
are quiet: rows fires/s), with the stack captured (the default) and
without. Also checked: recorded == what the target saw, skipped == 0.

The copilot runs on this kernel (6.18); for the regs mechanism run it in
the sid 7.2 VM: `python3 vm/vmrun.py --kernel sid --cwd $PWD -- python3
bench/bench_fires.py` (TCG: compare only with other TCG numbers). JSON.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gftarget import LIB, Target  # noqa: E402

from pyctl.capabilities import regs_writable  # noqa: E402
from pyctl.engine import Engine  # noqa: E402
from pyctl.spec import FaultSpec  # noqa: E402

N = int(os.environ.get("GF_BENCH_FIRES", "12000"))  # the 8 MiB ring holds 16384


def one(stack: bool, db: Path) -> dict:
    t = Target()
    spec = FaultSpec(lib=str(LIB), fn="gf_victim", action="fail", ret=-5, every=1,
                     capture_stack=stack, tgid=t.pid)
    eng = Engine([spec], db_path=db, pid=t.pid, argv=["bench-fires"])
    eng.start()
    try:
        # Warm-up: the first fires read the symbol tables of the libraries
        # on the stack (libc's debug file: ~1 s, once per run).
        t.victim(100)
        eng.drain()
        t0 = time.perf_counter()
        rows = t.victim(N)
        t_target = time.perf_counter() - t0
        # Stage 1, what decides whether a fire finds room in the ring: the
        # records leave it into the fire_journal table, one INSERT a batch.
        t0 = time.perf_counter()
        stored = 0
        while True:
            span, n = eng.fires.take_span(512)
            if not n:
                break
            eng.evidence.journal_fires(span, n)
            stored += n
        t_store = time.perf_counter() - t0
        # Stage 2, when the rings are quiet: journal -> faults, registers,
        # args, stacks rows (and the calls ring, which holds little here).
        t0 = time.perf_counter()
        got = stored + eng.drain()
        t_drain = time.perf_counter() - t0
        lost = eng.lost()
        mech = eng.mechanism
    finally:
        eng.close()
        t.close()
    failed = sum(1 for r in rows if r[3] == -5) + 100
    import sqlite3

    recorded = sqlite3.connect(db).execute("SELECT count(*) FROM faults").fetchone()[0]
    return {"mechanism": mech, "stack": stack, "fires": N + 100, "target_saw": failed,
            "recorded": recorded, "skipped": lost["fires_skipped"], "records_read": got,
            "target_s": round(t_target, 3), "store_s": round(t_store, 4),
            "rows_s": round(t_drain, 3), "fires_per_s_target": round(N / t_target),
            "stored_fires_per_s": round(N / t_store), "rows_fires_per_s": round(N / t_drain)}


def main() -> None:
    out = {"kernel": platform.release(), "regs_writable": regs_writable(), "runs": []}
    with tempfile.TemporaryDirectory() as d:
        for stack in (False, True):
            out["runs"].append(one(stack, Path(d) / f"f{int(stack)}.db"))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
