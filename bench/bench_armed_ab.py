"""Armed-not-firing cost of two builds of gpufault.bpf.o, interleaved in one
run (issue 26: the signal path must not change it): `fail --nth 10^15` on
gf_empty, per call, beside the empty-uprobe floor, rounds alternating
between OLD and NEW objects so the machine's load hits both alike.

sudo python3 bench/bench_armed_ab.py OLD.bpf.o NEW.bpf.o [-o out.json]
(OLD: e.g. bpf/gpufault.bpf.c of the commit before, built with the
Makefile's BPF_CFLAGS.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

from bench_engine import floor, with_engine  # noqa: E402
from gftarget import LIB, Target  # noqa: E402

from pyctl.bpf import main_object  # noqa: E402
from pyctl.spec import FaultSpec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-o", "--output", type=Path)
    a = ap.parse_args()
    res: dict[str, list[float]] = {"old": [], "new": [], "floor": []}
    t = Target()
    try:
        with tempfile.TemporaryDirectory() as d:
            for _ in range(a.rounds):
                res["floor"].append(floor(t))
                for name in ("old", "new"):
                    main_object.MAIN_OBJ = getattr(a, name)  # what the engine loads
                    spec = FaultSpec(lib=str(LIB), fn="gf_empty", action="fail", ret=1, nth=10**15)
                    ns, _ = with_engine(t, spec, Path(d) / f"{name}.db", concurrent=False)
                    res[name].append(ns)
    finally:
        t.close()
    fl = min(res["floor"])
    out = {
        "when_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "loadavg": os.getloadavg()[0],
        "ns_per_call": res,
        "ratio_to_floor_best": {k: round(min(res[k]) / fl, 3) for k in ("old", "new")},
        "ratio_to_floor_median": {
            k: round(statistics.median(res[k]) / statistics.median(res["floor"]), 3)
            for k in ("old", "new")
        },
    }
    text = json.dumps(out, indent=2)
    print(text)
    if a.output:
        a.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
