"""Merge several gpufault databases (one per node, per rank, per agent)
into one, so that `faults`, `show`, `timeline` and the report read the
whole service's evidence in one store.

The unit is a run (a run_id and everything keyed by it or by its faults'
ids) and an experiment (its id and its rows). A run id has a host part
and a random half (16 hex digits; 8 random ones in older stores:
pyctl/evidence/hostid.py), an experiment's is "x" and 8 random ones, so
ids from different hosts do not meet; when one does:
- the same run already in the destination, row for row the same: it is
  skipped (merging a file twice, or a file and its copy, adds nothing);
- a different run under the same id: the merge is refused, one line,
  with the destination untouched (one transaction for everything).

Sources are opened read-only through store.open_db (checked like every
reader: root's, gpufault's, every page readable); older schemas read
through its stand-ins, columns a source lacks arrive NULL. Integer row
ids (links, xids, anchors) are the destination's own.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyctl.evidence import schema, store
from pyctl.exceptions import BadInput

_BATCH = 10_000
# Tables whose integer `id` is a row id: the destination assigns its own.
_ROW_ID = ("links", "xids", "anchors")
# Keyed by a fault id alone (no run_id column): copied for the new runs' faults.
_BY_FAULT = ("registers", "args", "stacks", "pyframes", "anchors")


class MergeError(BadInput):
    """One line: which source, which id, what to do."""


@dataclass
class SourceStats:
    path: str
    runs_added: int = 0
    runs_skipped: int = 0  # already in the destination, identical
    runs_running: int = 0  # still running in the source, left out (skip_running)
    experiments_added: int = 0
    experiments_skipped: int = 0
    rows: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        faults = self.rows.get("faults", 0)
        calls = self.rows.get("calls", 0)
        skipped = f", {self.runs_skipped} already there" if self.runs_skipped else ""
        if self.runs_running:
            skipped += f", {self.runs_running} still running (left out: merge again when ended)"
        exps = ""
        if self.experiments_added or self.experiments_skipped:
            exps = f", {self.experiments_added} experiments"
            if self.experiments_skipped:
                exps += f" ({self.experiments_skipped} already there)"
        return (f"{self.path}: {self.runs_added} runs{skipped}{exps}, {faults} faults, "
                f"{calls} call rows")  # fmt: skip


def _cols(conn: sqlite3.Connection, table: str) -> list[str]:
    cur = conn.execute(f'SELECT * FROM "{table}" LIMIT 0')
    return [d[0] for d in cur.description]


def _tables() -> list[schema.Table]:
    return list(schema.TABLES)


def _same(src: sqlite3.Connection, dst: sqlite3.Connection, table: str, key: str,
          value: str) -> bool | None:  # fmt: skip
    """None: value not in dst; True: the same row; False: another row."""
    have = dst.execute(f'SELECT * FROM "{table}" WHERE "{key}" = ?', (value,)).fetchone()
    if have is None:
        return None
    dcols = _cols(dst, table)
    scols = _cols(src, table)
    common = [c for c in dcols if c in scols]
    a = src.execute(f'SELECT {", ".join(f"{chr(34)}{c}{chr(34)}" for c in common)} FROM "{table}" '
                    f'WHERE "{key}" = ?', (value,)).fetchone()  # fmt: skip
    b = dst.execute(f'SELECT {", ".join(f"{chr(34)}{c}{chr(34)}" for c in common)} FROM "{table}" '
                    f'WHERE "{key}" = ?', (value,)).fetchone()  # fmt: skip
    return a == b


def _copy(src: sqlite3.Connection, dst: sqlite3.Connection, table: str, where: str,
          params: Sequence[Any]) -> int:  # fmt: skip
    dcols = _cols(dst, table)
    scols = set(_cols(src, table))
    cols = [c for c in dcols if not (table in _ROW_ID and c == "id")]
    sel = ", ".join(f'"{c}"' if c in scols else "NULL" for c in cols)
    cur = src.execute(f'SELECT {sel} FROM "{table}" {where}', tuple(params))
    ins = (f'INSERT INTO "{table}" ({", ".join(chr(34) + c + chr(34) for c in cols)}) '
           f'VALUES ({", ".join("?" for _ in cols)})')  # fmt: skip
    n = 0
    while rows := cur.fetchmany(_BATCH):
        dst.executemany(ins, rows)
        n += len(rows)
    return n


def _in(ids: Iterable[str]) -> tuple[str, list[str]]:
    ids = list(ids)
    return "(" + ",".join("?" for _ in ids) + ")", ids


def _merge_one(src: sqlite3.Connection, dst: sqlite3.Connection, path: str,
               skip_running: bool = False, runs: Collection[str] | None = None
               ) -> SourceStats:  # fmt: skip
    st = SourceStats(path)
    new_runs = []
    for rid, status in src.execute(
        "SELECT run_id, status FROM runs ORDER BY started, run_id"
    ).fetchall():
        if runs is not None and rid not in runs:
            continue
        if skip_running and status == "running":
            # Its rows are still being written: a copy now would clash with
            # the ended run a later merge brings (same id, other contents).
            st.runs_running += 1
            continue
        same = _same(src, dst, "runs", "run_id", rid)
        if same is None:
            new_runs.append(rid)
        elif same:
            st.runs_skipped += 1
        else:
            raise MergeError(f"{path}: run {rid} is already in the destination with other "
                             "contents (two hosts drew the same run id): merge that source "
                             "into another database")  # fmt: skip
    new_exps = []
    xids = [] if runs is not None else src.execute("SELECT id FROM experiments ORDER BY id")
    for (xid,) in xids:
        same = _same(src, dst, "experiments", "id", xid)
        if same is None:
            new_exps.append(xid)
        elif same:
            st.experiments_skipped += 1
        else:
            raise MergeError(f"{path}: experiment {xid} is already in the destination with "
                             "other contents: merge that source into another database")  # fmt: skip
    exp_tables = set(schema.EXPERIMENT_TABLES)
    # Chunks of ids: SQLite's bound-parameter limit.
    for i in range(0, len(new_runs), 500):
        chunk = new_runs[i : i + 500]
        marks, ids = _in(chunk)
        for t in _tables():
            if t.name in exp_tables:
                continue
            cols = _cols(src, t.name)
            if "run_id" in cols:
                n = _copy(src, dst, t.name, f"WHERE run_id IN {marks}", ids)
            elif t.name in _BY_FAULT and "fault_id" in cols:
                n = _copy(src, dst, t.name, "WHERE fault_id IN (SELECT fault_id FROM faults "
                          f"WHERE run_id IN {marks})", ids)  # fmt: skip
            else:
                continue
            st.rows[t.name] = st.rows.get(t.name, 0) + n
    for i in range(0, len(new_exps), 500):
        marks, ids = _in(new_exps[i : i + 500])
        for name in schema.EXPERIMENT_TABLES:
            key = "id" if name == "experiments" else "experiment_id"
            n = _copy(src, dst, name, f"WHERE {key} IN {marks}", ids)
            st.rows[name] = st.rows.get(name, 0) + n
    st.runs_added, st.experiments_added = len(new_runs), len(new_exps)
    return st


def merge(sources: Sequence[str | os.PathLike[str]], into: str | os.PathLike[str],
          *, skip_running: bool = False, runs: Collection[str] | None = None
          ) -> list[SourceStats]:  # fmt: skip
    """Merge every source into `into` (created if missing) in one
    transaction; raises MergeError/StoreError (BadInput) with `into` as it
    was (a file this call created is removed). skip_running: leave out
    the runs a source still has running (a live agent's store). runs:
    only these run ids, and no experiments (an experiment's own steps
    pulled from the agents that armed them)."""
    if not sources:
        raise MergeError(
            "give the databases to merge: gpufault evidence merge A.db B.db --into ALL.db"
        )
    real_into = os.path.realpath(into)
    for s in sources:
        if os.path.realpath(s) == real_into:
            raise MergeError(f"{s}: is the destination itself: give another --into")
    srcs = []
    try:
        for s in sources:
            srcs.append((str(s), store.open_db(s, readonly=True)))
        dst = store.open_db(into)
        created = bool(getattr(dst, "gf_created", False))
        ok = False
        try:
            dst.conn.execute("BEGIN IMMEDIATE")
            try:
                out = [_merge_one(db.conn, dst.conn, path, skip_running, runs)
                       for path, db in srcs]  # fmt: skip
                dst.conn.execute("COMMIT")
                ok = True
            except BaseException:
                dst.conn.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:
            raise MergeError(f"{into}: {e}") from None
        finally:
            dst.close()
            if created and not ok:
                store.remove_db(Path(into))
        return out
    finally:
        for _, db in srcs:
            db.close()
