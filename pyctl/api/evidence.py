"""The evidence store read as objects: a fault ID's record, its chain
(`gpufault show`'s text and JSON), a run's faults.

Read-only (SQLite mode=ro through pyctl.evidence.store): reading never creates,
converts or chmods the file, so a harness may read a database a run is
still writing (WAL).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyctl.api.errors import BadInput, translate

_FAULT_SQL = (
    "SELECT f.fault_id, f.run_id, f.function, f.library, f.action, f.mechanism, f.retval, "
    "f.ret, f.latency_ns, f.call_seq, f.pid, f.tid, f.comm, f.wall, "
    "(SELECT count(*) FROM links l WHERE l.fault_id = f.fault_id) AS links FROM faults f "
)


@dataclass(frozen=True)
class FaultRecord:
    """One fired fault: the row `gpufault faults` lists."""

    fault_id: str
    run_id: str
    function: str
    library: str
    action: str
    mechanism: str
    retval: int | None  # what was injected (fail), else None
    ret: int | None  # what the caller saw returned, where the call returned
    latency_ns: int | None
    call_seq: int
    pid: int
    tid: int
    comm: str
    wall: float  # Unix time of the fire
    links: int  # what followed, linked by the evidence rules
    db_path: str = field(repr=False, default="")

    @classmethod
    def from_row(cls, row: dict[str, Any], db_path: str) -> FaultRecord:
        names = set(cls.__dataclass_fields__) - {"db_path"}
        return cls(**{k: row.get(k) for k in names}, db_path=db_path)  # type: ignore[arg-type]

    def chain(self) -> dict[str, Any]:
        """Everything known about it (`gpufault show --json`)."""
        with Evidence(self.db_path) as ev:
            return ev.chain(self.fault_id)

    def show(self) -> str:
        """`gpufault show FAULT_ID`'s text."""
        # lazy: keeps pyctl.evidence.query (+30 modules, ~100 ms) off `import gpufault`
        from pyctl.evidence import query

        return query.render_chain(self.chain())


class Evidence:
    """A gpufault database, opened read-only."""

    def __init__(self, db_path: str | os.PathLike[str]) -> None:
        # lazy: keeps pyctl.evidence.store (+15 modules) off `import gpufault`
        from pyctl.evidence import store

        self.db_path = str(db_path)
        try:
            self._db = store.open_db(self.db_path, readonly=True)
        except Exception as e:  # noqa: BLE001 - StoreError, sqlite3 errors: one line
            raise translate(e) from e

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Evidence:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _records(self, where: str, params: tuple[Any, ...]) -> list[FaultRecord]:
        cur = self._db.conn.execute(_FAULT_SQL + where, params)
        cols = [c[0] for c in cur.description]
        return [
            FaultRecord.from_row(dict(zip(cols, r, strict=True)), self.db_path)
            for r in cur.fetchall()
        ]

    def faults(
        self, run_id: str | None = None, *, function: str | None = None,
        since: float | None = None,
    ) -> list[FaultRecord]:  # fmt: skip
        """Fired faults in fire order (oldest first); function is a GLOB."""
        conds, params = [], []
        for cond, value in (("f.run_id = ?", run_id), ("f.function GLOB ?", function),
                            ("f.wall >= ?", since)):  # fmt: skip
            if value not in (None, ""):
                conds.append(cond)
                params.append(value)
        where = ("WHERE " + " AND ".join(conds)) if conds else ""
        return self._records(f"{where} ORDER BY f.wall, f.seq", tuple(params))

    def __iter__(self) -> Iterator[FaultRecord]:
        return iter(self.faults())

    def fault(self, fault_id: str) -> FaultRecord:
        rows = self._records("WHERE f.fault_id = ?", (fault_id,))
        if not rows:
            raise BadInput(f"no fault {fault_id} in {self.db_path}: list them with faults()")
        return rows[0]

    def chain(self, fault_id: str) -> dict[str, Any]:
        # lazy: keeps pyctl.evidence.query (+30 modules, ~100 ms) off `import gpufault`
        from pyctl.evidence import query

        doc = query.fault_chain(self._db, fault_id)
        if doc is None:
            raise BadInput(f"no fault {fault_id} in {self.db_path}: list them with faults()")
        return doc

    def run(self, run_id: str) -> dict[str, Any]:
        """The run's row (kind, status, started, ended; stats as a dict)."""
        cur = self._db.conn.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        row = cur.fetchone()
        if row is None:
            raise BadInput(f"no run {run_id} in {self.db_path}")
        doc = dict(zip([c[0] for c in cur.description], row, strict=True))
        if isinstance(doc.get("stats"), str):
            try:
                doc["stats"] = json.loads(doc["stats"])
            except ValueError:
                pass
        return doc


def open_evidence(db_path: str | os.PathLike[str]) -> Evidence:
    return Evidence(db_path)


def merge_evidence(
    sources: Sequence[str | os.PathLike[str]],
    into: str | os.PathLike[str],
    *,
    skip_running: bool = False,
    runs: Collection[str] | None = None,
) -> list[Any]:
    """Merge several databases (nodes, ranks, agents) into `into`, created
    if missing, in one transaction: every run and experiment of each
    source once (one already there, the same, is skipped; another under
    the same id is refused with `into` untouched). Returns per source a
    SourceStats (runs_added, runs_skipped, rows per table, .line()).
    skip_running leaves out the runs a source still has running; runs
    merges only those run ids (and no experiments)."""
    # lazy: keeps pyctl.evidence.merge off `import gpufault`
    from pyctl.evidence import merge

    try:
        return merge.merge(sources, into, skip_running=skip_running, runs=runs)
    except Exception as e:  # noqa: BLE001 - MergeError, StoreError: one line
        raise translate(e) from e


__all__ = ["Evidence", "FaultRecord", "merge_evidence", "open_evidence"]
