"""Latency one injected `fail` adds to the call, seen from inside the target
(CLOCK_MONOTONIC around each gf_victim call, every call failed), per
mechanism available on this kernel: the ptrace copilot always; the regs
mechanism where the verifier allows register writes (run this file inside
the sid 7.2 VM with `python3 vm/vmrun.py --kernel sid --cwd $PWD -- python3
bench/bench_fail.py`; TCG numbers are only comparable with each other).
Prints JSON.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # an installed gpufault (the wheel) wins, else this checkout
sys.path.insert(0, str(REPO / "tests"))

from gftarget import LIB, Target  # noqa: E402

from pyctl.capabilities import regs_writable  # noqa: E402
from pyctl.engine import Engine  # noqa: E402
from pyctl.spec import FaultSpec  # noqa: E402

N = int(os.environ.get("GF_BENCH_FAILS", "2000"))
PAT = re.compile(r"timed n=(\d+) p50=(\d+) p99=(\d+) max=(\d+) failed=(\d+)")


def timed(t: Target, n: int) -> dict:
    (line,) = [x for x in t.cmd(f"timed {n}") if x.startswith("timed")]
    m = PAT.match(line)
    assert m
    n_, p50, p99, mx, failed = (int(x) for x in m.groups())
    return {"p50_ns": p50, "p99_ns": p99, "max_ns": mx, "failed": failed, "calls": n_}


def with_fault(t: Target, use_regs: bool, db: Path) -> dict:
    spec = FaultSpec(
        lib=str(LIB),
        fn="gf_victim",
        action="fail",
        ret=-5,
        every=1,
        capture_stack=False,
        tgid=t.pid,
    )
    eng = Engine([spec], db_path=db, pid=t.pid, argv=["bench-fail"], use_regs=use_regs)
    eng.start()
    try:
        timed(t, 50)  # warm-up
        r = timed(t, N)
        eng.drain()
        r["mechanism"] = eng.mechanism
        return r
    finally:
        eng.close()


def main() -> None:
    out: dict = {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "calls": N,
        "regs_available": regs_writable(),
    }
    t = Target()
    try:
        with tempfile.TemporaryDirectory() as d:
            out["no_fault"] = timed(t, N)
            out["copilot"] = with_fault(t, False, Path(d) / "c.db")
            if regs_writable():
                out["regs"] = with_fault(t, True, Path(d) / "r.db")
    finally:
        t.close()
    base = out["no_fault"]["p50_ns"]
    for k in ("copilot", "regs"):
        if k in out:
            out[k]["added_p50_us"] = round((out[k]["p50_ns"] - base) / 1000, 2)
            out[k]["added_p99_us"] = round((out[k]["p99_ns"] - base) / 1000, 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
