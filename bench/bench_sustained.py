"""Sustained ingest (issue 26): a trace of gf_empty paced at RATE calls/s
for SECONDS (default 300,000/s for 60 s), the consumer draining the ring
into SQLite all along. Reports per second of the run the events stored
and the ring's backlog, and at the end the calls the target made, the
events stored and the events lost (BPF's exact count), so the sustained
limit shows as the rate at which the backlog stops being flat.

    sudo python3 bench/bench_sustained.py [RATE [SECONDS]] > out.json
    python3 bench/bench_sustained.py --insert [N]   # the store's side alone

GF_BENCH_DB_DIR puts the store elsewhere (/dev/shm: no disk);
GPUFAULT_CALL_ROWS_PER_INSERT=1 is the one-record insert of before
(pyctl/evidence/store.py), for a side-by-side run.

Needs root and `make build`. Prints JSON.
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
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
    # GF_BENCH_DB_DIR: where the store goes (/dev/shm: the disk taken out).
    d = Path(tempfile.mkdtemp(prefix="gf-sustained-", dir=os.environ.get("GF_BENCH_DB_DIR")))
    spec = FaultSpec(lib=str(LIB), fn="gf_empty", trace=True, entry_only=True,
                     capture_stack=False, tgid=t.pid)  # fmt: skip
    eng = Engine([spec], db_path=d / "gf.db", pid=t.pid, argv=["bench-sustained"],
                 ring_mib=ring_mib, max_db_bytes=0)  # fmt: skip
    # No --max-db-size cap: 60 s at 300k/s is ~1.4 GB, over the 1 GiB
    # default, past which call rows are counted as dropped, not stored
    # (an earlier run on the H200 reported those as stored).
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
    with sqlite3.connect(d / "gf.db") as c:  # what was counted stored is in the store
        (rows,) = c.execute("SELECT count(*) FROM calls").fetchone()
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    rates = sorted(p["stored_per_s"] for p in per_s)
    return {
        "rate": rate, "seconds": seconds, "calls": n, "ring_mib": ring_mib,
        "events_stored": got - eng.stats.dropped, "events_dropped_at_cap": eng.stats.dropped,
        "rows_in_store": rows,
        "events_lost": lost["events_lost"],
        "lost_why": lost.get("events_lost_why"),
        "produce_s": round(produced_s, 2), "drain_tail_s": round(el - produced_s, 2),
        "stored_per_s_median": rates[len(rates) // 2] if rates else None,
        "stored_per_s_min": rates[0] if rates else None,
        "store_mib": round(size / 2**20, 1), "per_second": per_s,
    }  # fmt: skip


def insert_only(n: int) -> dict[str, object]:
    """The store's side alone: n call records (4,096 a batch, one
    transaction each, as the drain makes them) into a new store, no BPF,
    no target: the rows/s the ingest could reach with the ring read free."""
    import struct

    from pyctl.bpf import abi
    from pyctl.evidence import store

    rec = struct.Struct(abi.CALL_RECORD_FMT)
    d = Path(tempfile.mkdtemp(prefix="gf-insert-", dir=os.environ.get("GF_BENCH_DB_DIR")))
    db = store.open_db(d / "gf.db")
    rid = store.new_run(db, ["bench-insert"], "trace", mechanism="bpf", capabilities={})
    # ring header, gf_hdr, ts, latency, cookie, call_seq, fault_seq, args, ret, pid, tid
    one = (120, 0, 1, 112, 0, 900, abi.cookie(0, 0), 0, 0, 1, 2, 3, 4, 5, 6, 0, 1234, 1235)
    ts, seq = abi.CALL_IX["ts_ns"], abi.CALL_IX["call_seq"]
    batch = b"".join(
        rec.pack(*(10**9 + i if j == ts else i + 1 if j == seq else v for j, v in enumerate(one)))
        for i in range(4096)
    )
    done, t0 = 0, time.perf_counter()
    while done < n:
        rows = list(rec.iter_unpack(batch))
        with db.conn:
            store.insert_call_records(db, rid, rows)
        done += len(rows)
    el = time.perf_counter() - t0
    db.conn.close()
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    return {"rows": done, "rows_per_s": round(done / el),
            "rows_per_insert": store.CALL_ROWS_PER_INSERT}  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["--insert"]:
        n = int(sys.argv[2]) if len(sys.argv) > 2 else 2_000_000
        print(json.dumps({"host": platform.node(), "insert_only": insert_only(n)}))
        return
    rate = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    out = {"host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
           "load_before": os.getloadavg()[0], "run": run(rate, seconds)}  # fmt: skip
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
