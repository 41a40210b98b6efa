"""Sustained ingest (issue 26): a trace of gf_empty paced at RATE calls/s
for SECONDS (default 300,000/s for 60 s), the consumer draining the ring
into SQLite all along. Reports per second of the run the events stored
and the ring's backlog, and at the end the calls the target made, the
events stored and the events lost (BPF's exact count), so the sustained
limit shows as the rate at which the backlog stops being flat.

    sudo python3 bench/bench_sustained.py [RATE [SECONDS]] > out.json

Needs root and `make build`. Prints JSON.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gftarget import LIB, Target  # noqa: E402

from pyctl.engine import Engine  # noqa: E402
from pyctl.spec import FaultSpec  # noqa: E402


def run(rate: int, seconds: float, ring_mib: int = 64) -> dict[str, object]:
    n = int(rate * seconds)
    t = Target()
    d = Path(tempfile.mkdtemp(prefix="gf-sustained-"))
    spec = FaultSpec(lib=str(LIB), fn="gf_empty", trace=True, entry_only=True,
                     capture_stack=False, tgid=t.pid)  # fmt: skip
    eng = Engine([spec], db_path=d / "gf.db", pid=t.pid, argv=["bench-sustained"],
                 ring_mib=ring_mib)  # fmt: skip
    eng.start()
    done = threading.Event()

    def drive() -> None:
        t.cmd(f"pace {n} {rate}")
        done.set()

    per_s: list[dict[str, float]] = []
    th = threading.Thread(target=drive)
    t0 = time.perf_counter()
    th.start()
    got, mark, at_mark = 0, t0 + 1, 0
    while not done.is_set():
        got += eng.poll(0.01)
        now = time.perf_counter()
        if now >= mark:
            per_s.append({"t": round(now - t0, 2), "stored_per_s": got - at_mark,
                          "lost_so_far": eng.lost()["events_lost"]})  # fmt: skip
            mark, at_mark = mark + 1, got
    produced_s = time.perf_counter() - t0
    while k := eng.drain():
        got += k
    el = time.perf_counter() - t0
    th.join()
    lost = eng.lost()
    eng.close()
    t.close()
    size = sum(f.stat().st_size for f in d.iterdir())
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    rates = sorted(p["stored_per_s"] for p in per_s)
    return {
        "rate": rate, "seconds": seconds, "calls": n, "ring_mib": ring_mib,
        "events_stored": got, "events_lost": lost["events_lost"],
        "lost_why": lost.get("events_lost_why"),
        "produce_s": round(produced_s, 2), "drain_tail_s": round(el - produced_s, 2),
        "stored_per_s_median": rates[len(rates) // 2] if rates else None,
        "stored_per_s_min": rates[0] if rates else None,
        "store_mib": round(size / 2**20, 1), "per_second": per_s,
    }  # fmt: skip


def main() -> None:
    rate = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    out = {"host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
           "load_before": os.getloadavg()[0], "run": run(rate, seconds)}  # fmt: skip
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
