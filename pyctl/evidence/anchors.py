"""Anchor records into SQLite, table `anchors` keyed by fault_id (the
records come from pyctl/anchors/, the kernel side, a floor below).

A reset's begin and end share one fault ID, so the key is an index on
fault_id, not the primary key; the row id is the primary key."""

from __future__ import annotations

import json
from collections.abc import Iterable

from pyctl.anchors.record import AnchorRecord
from pyctl.evidence import schema
from pyctl.evidence.sqlitedb import Database, Table

TABLE = "anchors"


def ensure_schema(db: Database) -> Table:
    """The anchors table (with every other one: pyctl/evidence/schema.py)."""
    schema.ensure_schema(db)
    return db.table(TABLE)


def to_row(rec: AnchorRecord) -> dict[str, object]:
    return {
        "fault_id": rec.fault_id,
        "kind": rec.kind,
        "run_id": rec.run_id,
        "fault_seq": rec.fault_seq,
        "from_context": int(rec.from_context),
        "rec_seq": rec.rec_seq,
        "mono_ns": rec.mono_ns,
        "wall_ns": rec.wall_ns,
        "bdf": rec.bdf,
        "vendor": rec.vendor,
        "device": rec.device,
        "code": rec.code,
        "pid": rec.pid,
        "ctx_pid": rec.ctx_pid,
        "comm": rec.comm,
        "config_ok": int(rec.config_ok),
        "config": rec.config,
        "devsta": rec.devsta,
        "aer_pos": rec.aer_pos,
        "aer": json.dumps(rec.aer) if rec.aer is not None else None,
        "bar0": json.dumps({f"0x{off:04x}": val for off, val in rec.bar0.items()}),
    }


def _full_fault_ids(db: Database, rows: list[dict[str, object]]) -> None:
    """The module carries a run id's random half (a u32): give its records
    the full id of the run in this store whose random half it is
    (store.new_run keeps the halves unique per store). A record of a run
    this store does not have keeps the module's 8-digit id."""
    halves = {str(r["fault_id"]).partition("-")[0] for r in rows if r["run_id"]}
    full: dict[str, str] = {}
    for half in halves:
        got = db.conn.execute(
            "SELECT run_id FROM runs WHERE length(run_id) = 16 AND substr(run_id, 9) = ?",
            [half],
        ).fetchone()
        if got is not None:
            full[half] = got[0]
    for r in rows:
        half, _, seq = str(r["fault_id"]).partition("-")
        if half in full:
            r["fault_id"] = f"{full[half]}-{seq}"


def store_records(db: Database, records: Iterable[AnchorRecord]) -> int:
    """Insert records; returns how many."""
    table = ensure_schema(db)
    rows = [to_row(r) for r in records]
    _full_fault_ids(db, rows)
    with db.conn:  # committed here: the recorder and the guest call this alone
        table.insert_all(rows)
    return len(rows)


def by_fault(db: Database, fault_id: str) -> list[dict[str, object]]:
    """Every anchor of one fault, oldest first."""
    ensure_schema(db)
    return list(db[TABLE].rows_where("fault_id = ?", [fault_id], order_by="mono_ns, id"))
