"""Lost events at 300k events/s: the consumer position in one store or not.

The target calls gf_empty paced at 300,000 calls/s for 900,000 calls while
the engine ingests (bench_engine's `ingest_sustained_300k`); the events
ring is 64 MiB, so the first ~560,000 records fill it once and from then
on a consumer position read as 0 makes the ring look full. Interleaved
rounds of two arms in one run:

- one store: RingReader._commit as shipped (a "Q" memoryview item);
- pack_into: the position written with struct.pack_into, as before
  2026-12-01 (zeroes the word, then writes it in pieces).

Per round: events lost and the BPF side's diagnosis (Engine.loss_causes).
Prints JSON. Needs root and `make build`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import struct
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

import bench_engine  # noqa: E402
from gftarget import Target  # noqa: E402

from pyctl.bpf.ringbuf import RingReader  # noqa: E402
from pyctl.engine import Engine  # noqa: E402

ROUNDS = int(os.environ.get("GF_BENCH_ROUNDS", "5"))
CALLS, RATE = 900_000, 300_000
ONE_STORE = RingReader._commit


def pack_into_commit(self: RingReader, pos: int) -> None:
    struct.pack_into("=Q", self.cons, 0, pos)


def one_round(t: Target, db: Path, commit) -> dict:  # type: ignore[no-untyped-def]
    seen: dict[str, int] = {}
    lost_of = Engine.lost

    def lost(self: Engine) -> dict[str, int]:
        seen.update(self.loss_causes())
        return lost_of(self)

    RingReader._commit = commit  # type: ignore[method-assign]
    Engine.lost = lost  # type: ignore[method-assign]
    try:
        r = bench_engine.ingest(t, db, CALLS, RATE)
    finally:
        RingReader._commit = ONE_STORE  # type: ignore[method-assign]
        Engine.lost = lost_of  # type: ignore[method-assign]
    return {**r, "why": {k: v for k, v in seen.items() if v}}


def main() -> int:
    if os.geteuid() != 0:
        print("bench_ring_commit: needs root (BPF)", file=sys.stderr)
        return 2
    arms = {"one_store": ONE_STORE, "pack_into": pack_into_commit}
    out: dict = {"machine": platform.node(), "kernel": platform.release(),
                 "load_before": os.getloadavg()[0], "rounds": {k: [] for k in arms}}  # fmt: skip
    t = Target()
    try:
        with tempfile.TemporaryDirectory() as d:
            for i in range(ROUNDS):
                for name, commit in arms.items():
                    out["rounds"][name].append(one_round(t, Path(d) / f"{name}{i}.db", commit))
    finally:
        t.close()
    out["load_after"] = os.getloadavg()[0]
    out["lost_per_round"] = {k: [r["events_lost"] for r in v] for k, v in out["rounds"].items()}
    out["median_events_per_s"] = {
        k: statistics.median(r["events_per_s"] for r in v) for k, v in out["rounds"].items()
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
