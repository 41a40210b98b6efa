"""pyctl/evidence/sqlitedb.py: the store's connection without sqlite-utils.

Each helper is checked against sqlite-utils itself on the same schema (the
code that calls these helpers was written against its API, and tests and
users still pass a sqlite_utils.Database in), and where ours differs on
purpose (no table or column made on the fly) the difference is asserted."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import sqlite_utils

from pyctl.evidence.sqlitedb import Database

SCHEMA = """
CREATE TABLE runs (run_id TEXT PRIMARY KEY, status TEXT, stats TEXT, n INTEGER);
CREATE TABLE pairs (a INTEGER, b INTEGER, v TEXT, PRIMARY KEY (a, b));
CREATE TABLE "values" (x INTEGER);
"""


def _both(tmp_path: Path) -> tuple[Database, sqlite_utils.Database]:
    ours = sqlite3.connect(tmp_path / "ours.db")
    theirs = sqlite3.connect(tmp_path / "theirs.db")
    for c in (ours, theirs):
        c.executescript(SCHEMA)
    return Database(ours), sqlite_utils.Database(theirs)


def _dump(conn: sqlite3.Connection) -> list[tuple]:
    return [
        (t, sorted(conn.execute(f'SELECT * FROM "{t}"').fetchall(), key=repr))
        for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY 1")
    ]


def test_the_same_rows_as_sqlite_utils(tmp_path: Path) -> None:
    ours, theirs = _both(tmp_path)
    for db in (ours, theirs):
        db["runs"].insert({"run_id": "a1", "status": "running", "stats": {"calls": 3}, "n": 1})
        db["runs"].insert_all(
            [
                {"run_id": "b2", "status": "done", "stats": None, "n": 2},
                {"run_id": "c3", "status": "done", "stats": [1, 2], "n": 3},
                {"run_id": "d4", "status": "x"},  # other columns: a second batch
            ]
        )
        db["runs"].update("a1", {"status": "done", "stats": {"calls": 4}})
        db["pairs"].insert_all({"a": i, "b": -i, "v": str(i)} for i in range(5))
        db["pairs"].update((3, -3), {"v": "three"})
        db["values"].insert({"x": 7})
        db.conn.commit()
    assert _dump(ours.conn) == _dump(theirs.conn)
    assert ours["runs"].count == theirs["runs"].count == 4
    assert list(ours["pairs"].rows_where("a >= ?", [3], order_by="a")) == list(
        theirs["pairs"].rows_where("a >= ?", [3], order_by="a")
    )
    assert list(ours["values"].rows) == [{"x": 7}]
    assert sorted(ours.table_names()) == sorted(theirs.table_names())


def test_no_table_or_column_is_made_on_the_fly(tmp_path: Path) -> None:
    # sqlite-utils would create them: here a name outside the schema is a bug.
    ours, _ = _both(tmp_path)
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        ours["runz"].insert({"run_id": "a"})
    with pytest.raises(sqlite3.OperationalError, match="no column named"):
        ours["runs"].insert({"run_id": "a", "stauts": "x"})
    assert ours.table_names() == sorted(["runs", "pairs", "values"])


def test_update_of_a_missing_row_or_a_wrong_key_fails(tmp_path: Path) -> None:
    ours, _ = _both(tmp_path)
    with pytest.raises(LookupError, match="no row"):
        ours["runs"].update("nope", {"status": "done"})
    with pytest.raises(ValueError, match="primary key"):
        ours["pairs"].update(1, {"v": "x"})


def test_a_write_joins_the_callers_transaction(tmp_path: Path) -> None:
    # Not sqlite-utils' commit per call: rows of one batch land together.
    ours, _ = _both(tmp_path)
    other = sqlite3.connect(tmp_path / "ours.db")
    ours["runs"].insert({"run_id": "a1"})
    assert other.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    with pytest.raises(sqlite3.OperationalError):
        with ours.conn:
            ours["runs"].insert({"run_id": "b2"})
            ours["runz"].insert({"run_id": "c3"})
    assert other.execute("SELECT count(*) FROM runs").fetchone() == (0,)  # rolled back whole
    with ours.conn:
        ours["runs"].insert({"run_id": "d4"})
    assert other.execute("SELECT run_id FROM runs").fetchall() == [("d4",)]
