"""The evidence store: one SQLite file per host (or per --db), written by one
process at a time.

Schema and queries go through sqlite-utils; the hot ingest path (call events)
uses a plain executemany in batched transactions, which is about 4x faster
here (see docs/benchmarks.md).

Safety: the file and its WAL/SHM siblings are created 0600 under a umask
of 077, so the evidence (registers, arguments, stacks) is readable only by
root. Every batch is one transaction, so a killed controller leaves every
committed row intact and no half-written one.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sqlite_utils
from sqlite_utils.db import Table

DEFAULT_DB = Path("/var/lib/gpufault/gpufault.db")
SCHEMA_VERSION = 1


def fault_id(run_id: str, seq: int) -> str:
    """Render the fault ID of the seq-th fire in a run: '1a2b3c4d-7'."""
    return f"{run_id}-{seq}"


def open_db(path: str | os.PathLike[str] = DEFAULT_DB) -> sqlite_utils.Database:
    """Open (creating if needed) the store: WAL, mode 0600, schema applied."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    old = os.umask(0o077)
    try:
        if not p.exists():
            # Create the file ourselves so its mode never passes through 0644.
            fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
            os.close(fd)
        # One writer at a time, but not always the thread that opened it
        # (a controller may arm on one thread and consume on another).
        import sqlite3

        db = sqlite_utils.Database(sqlite3.connect(p, check_same_thread=False))
        db.conn.execute("PRAGMA journal_mode=WAL")
        db.conn.execute("PRAGMA synchronous=NORMAL")
        db.conn.execute("PRAGMA busy_timeout=5000")
        ensure_schema(db)
    finally:
        os.umask(old)
    for sibling in (p, Path(f"{p}-wal"), Path(f"{p}-shm")):
        if sibling.exists():
            os.chmod(sibling, 0o600)
    return db


def _t(db: sqlite_utils.Database, name: str) -> Table:
    t = db[name]
    assert isinstance(t, Table)
    return t


def ensure_schema(db: sqlite_utils.Database) -> None:
    """Create every table the engine writes. Idempotent."""
    with db.conn:
        _t(db, "runs").create(
            {
                "run_id": str,
                "argv": str,
                "kind": str,
                "kernel": str,
                "host": str,
                "mechanism": str,
                "capabilities": str,
                "started": float,
                "ended": float,
                "status": str,
                "exit_code": int,
                "stats": str,
            },
            pk="run_id",
            if_not_exists=True,
        )
        _t(db, "specs").create(
            {"run_id": str, "spec": int, "text": str, "json": str},
            pk=("run_id", "spec"),
            if_not_exists=True,
        )
        _t(db, "funcs").create(
            {
                "run_id": str,
                "func": int,
                "library": str,
                "build_id": str,
                "symbol": str,
                "offset": int,
                "address": int,
                "first_insn": str,
            },
            pk=("run_id", "func"),
            if_not_exists=True,
        )
        _t(db, "faults").create(
            {
                "fault_id": str,
                "run_id": str,
                "seq": int,
                "spec": int,
                "func": int,
                "function": str,
                "library": str,
                "build_id": str,
                "action": str,
                "mechanism": str,
                "retval": int,
                "call_seq": int,
                "pid": int,
                "tid": int,
                "comm": str,
                "ts_ns": int,
                "wall": float,
                "ret": int,
                "latency_ns": int,
                "outcome": str,
            },
            pk="fault_id",
            if_not_exists=True,
        )
        _t(db, "registers").create(
            {"fault_id": str, "reg": str, "value": int},
            pk=("fault_id", "reg"),
            if_not_exists=True,
        )
        _t(db, "args").create(
            {"fault_id": str, "idx": int, "name": str, "raw": int, "decoded": str},
            pk=("fault_id", "idx"),
            if_not_exists=True,
        )
        _t(db, "stacks").create(
            {
                "fault_id": str,
                "depth": int,
                "address": int,
                "symbol": str,
                "module": str,
                "offset": int,
            },
            pk=("fault_id", "depth"),
            if_not_exists=True,
        )
        _t(db, "links").create(
            {
                "id": int,
                "fault_id": str,
                "run_id": str,
                "kind": str,
                "rule": str,
                "ts_ns": int,
                "pid": int,
                "tid": int,
                "detail": str,
            },
            pk="id",
            if_not_exists=True,
        )
        db.execute(
            "CREATE TABLE IF NOT EXISTS calls ("
            "run_id TEXT, ts_ns INTEGER, latency_ns INTEGER, spec INTEGER, func INTEGER, "
            "call_seq INTEGER, fault_id TEXT, pid INTEGER, tid INTEGER, kind INTEGER, "
            "ret INTEGER, arg1 INTEGER, arg2 INTEGER, arg3 INTEGER, arg4 INTEGER, "
            "arg5 INTEGER, arg6 INTEGER)"
        )
        db.execute("CREATE INDEX IF NOT EXISTS calls_run ON calls(run_id, func)")
        db.execute("CREATE INDEX IF NOT EXISTS faults_run ON faults(run_id)")
        db.execute("CREATE INDEX IF NOT EXISTS links_fault ON links(fault_id)")
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")


def host_facts() -> dict[str, str]:
    u = platform.uname()
    return {"kernel": u.release, "host": socket.gethostname()}


def new_run(
    db: sqlite_utils.Database,
    argv: Sequence[str],
    kind: str,
    *,
    mechanism: str = "",
    capabilities: dict[str, Any] | None = None,
) -> str:
    """Insert a run row and return its 8-hex run id."""
    run_id = secrets.token_hex(4)
    facts = host_facts()
    with db.conn:
        _t(db, "runs").insert(
            {
                "run_id": run_id,
                "argv": json.dumps(list(argv)),
                "kind": kind,
                "kernel": facts["kernel"],
                "host": facts["host"],
                "mechanism": mechanism,
                "capabilities": json.dumps(capabilities or {}, sort_keys=True),
                "started": time.time(),
                "status": "running",
            }
        )
    return run_id


def end_run(
    db: sqlite_utils.Database,
    run_id: str,
    status: str,
    exit_code: int | None = None,
    stats: dict[str, Any] | None = None,
) -> None:
    with db.conn:
        _t(db, "runs").update(
            run_id,
            {
                "ended": time.time(),
                "status": status,
                "exit_code": exit_code,
                "stats": json.dumps(stats or {}, sort_keys=True),
            },
        )


# Ring records go straight from struct.iter_unpack to SQLite with no Python
# per row: each record binds, in order, to the plain `?`s of a one-row
# SELECT (c1..c18 = abi.CALL_RECORD_FMT's fields; c1/c2 are the ring header,
# c18 the flags), and the outer SELECT picks and computes the columns.
# Not numbered parameters (?3, ?5 ...) with a sequence: Python 3.12 warns
# per binding and row (10x slower: 23k rows/s on the H200 machine) and
# 3.14 refuses them.
_CALL_RECORD_SQL = (
    "INSERT INTO calls (run_id, ts_ns, latency_ns, spec, func, call_seq, fault_id, pid, tid, "
    "kind, ret, arg1, arg2, arg3, arg4, arg5, arg6) SELECT '{run}', c3, c4, c5 >> 32, "
    "c5 & 4294967295, c6, CASE WHEN c7 != 0 THEN '{run}-' || c7 END, c15, c16, c17, c14, "
    "c8, c9, c10, c11, c12, c13 FROM (SELECT "
    + ", ".join(f"? AS c{i}" for i in range(1, 19))
    + ")"
)


def insert_call_records(db: sqlite_utils.Database, run_id: str, records: list[tuple]) -> None:
    """Insert raw ring records (inside the caller's transaction)."""
    if not all(c in "0123456789abcdef" for c in run_id):
        raise ValueError("run ids are hex")
    db.conn.executemany(_CALL_RECORD_SQL.format(run=run_id), records)
