"""The explorations' rows in the evidence store (tables explorations,
explore_points, explore_trials; docs/schema.md). A trial row is written
once, whole, when its experiment ended: the rows present are the progress
`explore resume` continues from."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from typing import Any

from pyctl.evidence import store
from pyctl.explore.discover import Point
from pyctl.explore.plan import Trial


def new_id() -> str:
    return "e" + secrets.token_hex(4)


class ExploreStore:
    def __init__(self, db: str | os.PathLike[str]) -> None:
        self.db = store.open_db(db)  # migrates to the schema with the explore tables
        self.conn = self.db.conn

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> ExploreStore:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def start(
        self,
        xid: str,
        file: str,
        target: str,
        settings: dict[str, Any],
        started_at: float | None = None,
    ) -> None:
        with self.conn:
            self.conn.execute(
                "INSERT INTO explorations (id, file, target, started_at, status, settings, host) "
                "VALUES (?,?,?,?,?,?,?)",
                (
                    xid,
                    file,
                    target,
                    started_at or time.time(),
                    "discovering",
                    json.dumps(settings, sort_keys=True),
                    socket.gethostname(),
                ),
            )

    def discovered(
        self, xid: str, exp_id: str, points: list[Point], calls: int, trials: list[Trial]
    ) -> None:
        with self.conn:
            self.conn.executemany(
                "INSERT INTO explore_points (exploration_id, point, library, function, site, "
                "signature, stack, calls, rate, codes, example_fault) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (
                        xid,
                        p.point,
                        p.library,
                        p.function,
                        p.site,
                        p.signature,
                        json.dumps(list(p.stack)),
                        p.calls,
                        p.rate,
                        json.dumps(list(p.codes)),
                        p.example_fault,
                    )
                    for p in points
                ],
            )
            self.conn.execute(
                "UPDATE explorations SET discover_experiment=?, points=?, calls=?, status=?, "
                "settings=json_set(settings, '$.plan', json(?)) WHERE id=?",
                (
                    exp_id,
                    len(points),
                    calls,
                    "injecting",
                    json.dumps([t.to_json() for t in trials]),
                    xid,
                ),
            )

    def trial_done(self, xid: str, t: Trial, row: dict[str, Any]) -> None:
        with self.conn:
            self.conn.execute(
                "INSERT OR REPLACE INTO explore_trials (exploration_id, idx, point, action, code, "
                "status, outcome, reason, experiment_id, fires, recover_s, file, reproduce, "
                "started_at, ended_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    xid,
                    t.idx,
                    t.point,
                    t.action,
                    t.code,
                    row["status"],
                    row["outcome"],
                    row["reason"],
                    row.get("experiment_id"),
                    row.get("fires"),
                    row.get("recover_s"),
                    row.get("file"),
                    row.get("reproduce"),
                    row.get("started_at"),
                    row.get("ended_at"),
                ),
            )

    def finish(self, xid: str, status: str) -> None:
        with self.conn:
            self.conn.execute(
                "UPDATE explorations SET status=?, ended_at=? WHERE id=?",
                (status, time.time(), xid),
            )


def _rows(conn: Any, sql: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
    cur = conn.execute(sql, args)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def load(conn: Any, xid: str) -> dict[str, Any] | None:
    """One exploration as a document: its row, points, plan and trials.
    xid may be `latest`."""
    if not conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type='table' AND name='explorations'"
    ).fetchone():
        return None
    if xid == "latest":
        r = conn.execute("SELECT id FROM explorations ORDER BY started_at DESC LIMIT 1").fetchone()
        if r is None:
            return None
        xid = r[0]
    ex = _rows(conn, "SELECT * FROM explorations WHERE id=?", (xid,))
    if not ex:
        return None
    e = ex[0]
    e["settings"] = json.loads(e["settings"] or "{}")
    points = _rows(
        conn,
        "SELECT * FROM explore_points WHERE exploration_id=? ORDER BY calls DESC, point",
        (xid,),
    )
    for p in points:
        p["stack"] = json.loads(p["stack"] or "[]")
        p["codes"] = json.loads(p["codes"] or "[]")
    trials = _rows(conn, "SELECT * FROM explore_trials WHERE exploration_id=? ORDER BY idx", (xid,))
    return {
        "exploration": e,
        "points": points,
        "plan": e["settings"].get("plan", []),
        "trials": trials,
    }
