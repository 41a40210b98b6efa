"""Anchor records in table `anchors` keyed by fault_id: through sqlite-utils
(as a user's script would) and through the store's own connection."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import sqlite_utils

from pyctl.anchors import decode, uapi
from pyctl.anchors.synth import make_record
from pyctl.evidence.anchors import by_fault, store_records
from pyctl.evidence.sqlitedb import Database


def records() -> list:
    begin = make_record(kind=uapi.Anchor.RESET_BEGIN, rec_seq=1, mono_ns=10)
    end = make_record(kind=uapi.Anchor.RESET_END, rec_seq=2, mono_ns=20)
    other = make_record(kind=uapi.Anchor.MANUAL, rec_seq=3, run_id=0, fault_seq=1, mono_ns=30)
    return decode(bytes(begin) + bytes(end) + bytes(other))


def test_store_and_query_by_fault(tmp_db: Path) -> None:
    db = sqlite_utils.Database(tmp_db)
    assert store_records(db, records()) == 3
    rows = by_fault(db, "1a2b3c4d-7")
    assert [r["kind"] for r in rows] == ["reset_begin", "reset_end"]
    assert rows[0]["config"] == bytes(range(256))
    assert json.loads(rows[0]["bar0"]) == {"0x0000": 0x010000ED, "0x100000": None}
    assert [r["kind"] for r in by_fault(db, "kmod-1")] == ["manual"]
    assert by_fault(db, "ffffffff-1") == []


def test_schema_indexes_fault_id(tmp_db: Path) -> None:
    db = sqlite_utils.Database(tmp_db)
    store_records(db, records())
    table = db["anchors"]
    assert table.pks == ["id"]
    assert any(ix.columns == ["fault_id"] for ix in table.indexes)
    assert table.columns_dict["config"] is bytes


def test_store_appends(tmp_db: Path) -> None:
    db = sqlite_utils.Database(tmp_db)
    store_records(db, records())
    store_records(db, records()[:1])
    assert db["anchors"].count == 4
    assert store_records(db, []) == 0


def test_stored_records_are_committed_through_the_stores_own_connection(tmp_db: Path) -> None:
    # The recorder and the VM guest call store_records alone, with the
    # store's connection (no sqlite-utils, whose every call commits): the
    # rows must be there for another reader without a commit of the caller's.
    db = Database(sqlite3.connect(tmp_db))
    assert store_records(db, records()) == 3
    other = sqlite3.connect(tmp_db)
    assert other.execute("SELECT count(*) FROM anchors").fetchone() == (3,)
    assert [r["kind"] for r in by_fault(db, "1a2b3c4d-7")] == ["reset_begin", "reset_end"]
