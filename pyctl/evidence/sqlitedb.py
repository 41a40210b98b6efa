"""The evidence store's connection: sqlite3 with the few table helpers its
writers use (insert, insert_all, update, rows_where, rows, count).

Not sqlite-utils, on purpose: importing it cost 50-110 ms of every
`gpufault trace --pid` start before the probes were live (it brings
dateutil, pluggy and its plugin scan, and numpy and pandas where they are
installed), and what it adds is not wanted here: every table and column
comes from pyctl/evidence/schema.py, so an insert into a missing table or
column is a bug that must fail, never a table created on the fly. The
method names follow sqlite-utils', so a sqlite_utils.Database passed in by
a test or a user's script works with the same code.

One difference on purpose: a write here never commits by itself (each
sqlite-utils call does, which splits a caller's transaction). Writes join
the caller's transaction: wrap them in `with db.conn:` (or the engine's
_tx), so a batch of rows is committed whole or not at all.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any


def quote(name: str) -> str:
    """An SQL identifier, double-quoted (names come from our schema, but a
    quote costs nothing and keeps a reserved word such as "values" legal)."""
    return '"' + name.replace('"', '""') + '"'


def _value(v: Any) -> Any:
    # As sqlite-utils stores them: containers as JSON text.
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, default=str)
    return v


class Table:
    def __init__(self, db: Database, name: str) -> None:
        self.db = db
        self.name = name

    def _insert_sql(self, cols: Sequence[str]) -> str:
        return (
            f"INSERT INTO {quote(self.name)} ({', '.join(map(quote, cols))}) "
            f"VALUES ({', '.join('?' * len(cols))})"
        )

    def insert(self, row: Mapping[str, Any]) -> Table:
        cols = list(row)
        self.db.conn.execute(self._insert_sql(cols), [_value(row[c]) for c in cols])
        return self

    def insert_all(self, rows: Iterable[Mapping[str, Any]]) -> Table:
        """One executemany per run of rows with the same columns (in practice
        one for the whole batch)."""
        batch: list[list[Any]] = []
        cols: tuple[str, ...] = ()
        for row in rows:
            keys = tuple(row)
            if keys != cols and batch:
                self.db.conn.executemany(self._insert_sql(cols), batch)
                batch = []
            cols = keys
            batch.append([_value(row[c]) for c in cols])
        if batch:
            self.db.conn.executemany(self._insert_sql(cols), batch)
        return self

    def _pk(self) -> list[str]:
        info = self.db.conn.execute(f"PRAGMA table_info({quote(self.name)})").fetchall()
        pk = [r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5])]
        return pk or ["rowid"]

    def update(self, key: Any, updates: Mapping[str, Any]) -> Table:
        """Set `updates` on the row whose primary key is `key` (a value, or
        a tuple for a compound key); a missing row is an error."""
        pk = self._pk()
        keys = list(key) if isinstance(key, (tuple, list)) else [key]
        if len(keys) != len(pk):
            raise ValueError(f"{self.name}: key {key!r} does not match primary key {pk}")
        cols = list(updates)
        sets = ", ".join(f"{quote(c)} = ?" for c in cols)
        where = " AND ".join(f"{quote(c)} = ?" for c in pk)
        cur = self.db.conn.execute(
            f"UPDATE {quote(self.name)} SET {sets} WHERE {where}",
            [*(_value(updates[c]) for c in cols), *keys],
        )
        if cur.rowcount != 1:
            raise LookupError(f"{self.name}: no row with {dict(zip(pk, keys, strict=True))}")
        return self

    def rows_where(
        self, where: str | None = None, args: Sequence[Any] = (), order_by: str | None = None
    ) -> Iterator[dict[str, Any]]:
        sql = f"SELECT * FROM {quote(self.name)}"
        if where:
            sql += f" WHERE {where}"
        if order_by:
            sql += f" ORDER BY {order_by}"
        cur = self.db.conn.execute(sql, list(args))
        names = [d[0] for d in cur.description]
        for r in cur:
            yield dict(zip(names, r, strict=True))

    @property
    def rows(self) -> Iterator[dict[str, Any]]:
        return self.rows_where()

    @property
    def count(self) -> int:
        return int(self.db.conn.execute(f"SELECT count(*) FROM {quote(self.name)}").fetchone()[0])


class Database:
    """A connection and its tables by name (`db["runs"]`)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.gf_created = False  # set by store.open_db: this process made the file
        # Called once after close (store.open_db: note the file as checked).
        self.after_close: Callable[[], None] | None = None

    def __getitem__(self, name: str) -> Table:
        return Table(self, name)

    def table(self, name: str) -> Table:
        return Table(self, name)

    def table_names(self) -> list[str]:
        return [
            r[0]
            for r in self.conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
            )
        ]

    def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, params)

    def close(self) -> None:
        self.conn.close()
        then, self.after_close = self.after_close, None
        if then is not None:
            then()
