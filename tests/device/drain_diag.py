"""Why does the event drain run at ~27k events/s on the GPU machine (397k/s
on the CI machine)? Separates the parts: fsync latency of the database's
file system, SQLite inserts alone (in memory), reading the ring alone, and
the full drain with the database in /tmp and in /dev/shm.

    PYTHONPATH=.:tests:bench python -m tests.device.drain_diag   (root; prints JSON)
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import time
from pathlib import Path

import bench_engine as be
from gftarget import LIB, Target

from pyctl.engine import CALL_REC, Engine
from pyctl.spec import FaultSpec

N = 300_000


def fsync_ms(d: str) -> float:
    fd, name = tempfile.mkstemp(dir=d)
    try:
        ts = []
        for _ in range(20):
            os.write(fd, b"x" * 4096)
            t0 = time.perf_counter()
            os.fsync(fd)
            ts.append((time.perf_counter() - t0) * 1e3)
        return round(sorted(ts)[len(ts) // 2], 3)
    finally:
        os.close(fd)
        os.unlink(name)


def sqlite_mem_rows_per_s() -> int:
    con = sqlite3.connect(":memory:")
    con.execute("CREATE TABLE c (a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q)")
    rows = [tuple(range(17))] * N
    t0 = time.perf_counter()
    with con:
        con.executemany("INSERT INTO c VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    return round(N / (time.perf_counter() - t0))


def ring_only(t: Target, d: str) -> dict:
    spec = FaultSpec(
        lib=str(LIB), fn="gf_empty", trace=True, entry_only=True, capture_stack=False, tgid=t.pid
    )
    eng = Engine([spec], db_path=Path(d) / "r.db", pid=t.pid, argv=["diag"], ring_mib=256)
    eng.start()
    try:
        t.cmd(f"empty {N}")
        t0 = time.perf_counter()
        got = 0
        while rows := eng.events.read_fixed(CALL_REC):
            got += len(rows)
        el = time.perf_counter() - t0
        return {"events": got, "events_per_s": round(got / el)}
    finally:
        eng.close()


def main() -> None:
    out: dict = {
        "fsync_ms_median": {d: fsync_ms(d) for d in ("/tmp", "/dev/shm")},
        "sqlite_memory_rows_per_s": sqlite_mem_rows_per_s(),
    }
    t = Target()
    try:
        out["ring_read_only"] = ring_only(t, "/dev/shm")
        for d in ("/tmp", "/dev/shm"):
            with tempfile.TemporaryDirectory(dir=d) as td:
                out[f"drain_db_in_{d}"] = be.drain_capacity(t, Path(td) / "x.db", N)
    finally:
        t.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
