"""An experiment's evidence, in the same SQLite file as its faults' runs.

The experiment row is written when the run starts (verdict "running"), so
a runner that dies leaves an honest trace; everything else is written at
the end in one transaction with the verdict. Faults are linked through
experiment_steps.run_id = runs.run_id (fault ids are "<run_id>-<seq>").

EXPERIMENT_DDL is the schema other tools (report, exporter) are written
against; the schema owner folds it into the one versioned schema later.
Times are Unix seconds (time.time()).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pyctl.evidence import schema, store

# The experiment tables are defined once, in pyctl/evidence/schema.py; this
# is their CREATE script (kept under the old name for its readers).
EXPERIMENT_DDL = schema.script(schema.EXPERIMENT_TABLES)
# load_windows' streamed terms (loadgen.WindowStats attributes of the same names).
STREAMED = (
    "ttft_p50",
    "ttft_p95",
    "ttft_p99",
    "itl_p50",
    "itl_p95",
    "itl_p99",
    "output_tokens_per_s",
    "goodput",
)
LOAD_COLUMNS = (
    "experiment_id",
    "start",
    "end",
    "count",
    "p50",
    "p95",
    "p99",
    "error_rate",
    "throughput",
    "phase",
    *STREAMED,
)
_LOAD_INSERT = (
    "INSERT INTO load_windows ("
    + ", ".join(f'"{c}"' for c in LOAD_COLUMNS)
    + ") VALUES ("
    + ", ".join("?" for _ in LOAD_COLUMNS)
    + ")"
)


def new_id() -> str:
    """Short and printable like run ids; the x keeps it apart from them."""
    return "x" + secrets.token_hex(4)


def _real(v: Any) -> float | None:
    """A REAL column: NaN (an empty window's percentile) is stored as NULL."""
    if v is None or isinstance(v, bool):
        return None if v is None else float(v)
    if isinstance(v, (int, float)):
        return None if math.isnan(v) else float(v)
    return None


@dataclass(frozen=True)
class StepRow:
    """A step of the method as it ran (experiment_steps)."""

    idx: int
    name: str
    template: str | None
    spec: dict[str, Any]  # the step's table, its specs, where it went, its error, its check
    run_id: str | None
    planned_start: float
    planned_duration: float
    started_at: float | None
    ended_at: float | None
    fires: int
    status: str  # armed, done, not-fired, stopped, failed, skipped
    # The target's own name of the step's thread (/proc/PID/task/TID/comm
    # when it armed, or the comm the step was limited to); None: the whole process.
    thread_name: str | None = None


@dataclass(frozen=True)
class ProbeSample:
    """One probe sample, an abort's moment or a rollback (probe_samples)."""

    probe: str  # the probe's name, "abort:NAME" or "rollback:NAME"
    phase: str
    at: float
    ok: bool
    value: Any  # a number, or None
    detail: str


@dataclass(frozen=True)
class LoadWindow:
    window: Any  # a loadgen.WindowStats
    phase: str


@dataclass(frozen=True)
class Hypothesis:
    """One check of the steady state (hypothesis_results)."""

    phase: str  # before, during, after
    name: str  # a probe's name, or load.p99 / load.error_rate / ...
    ok: bool
    value: str
    tolerance: str
    detail: str
    slo_id: str = ""  # the [[slo]]'s id, or the file's slo_id for its steady state


@dataclass(frozen=True)
class Judged:
    metric: str
    judgement: Any  # a stats.Judgement
    slo_id: str = ""


@dataclass(frozen=True)
class Expectation:
    """alert_fired, degradation_worked, recovered_within, linked:WHAT."""

    name: str
    ok: bool
    value: float | None
    detail: str


@dataclass(frozen=True)
class RemediationRun:
    command: str
    started: float
    ended: float | None
    rc: int | None


@dataclass
class Record:
    """Everything an experiment writes at its end, as rows of its tables."""

    steps: list[StepRow] = field(default_factory=list)
    probe_samples: list[ProbeSample] = field(default_factory=list)
    load_windows: list[LoadWindow] = field(default_factory=list)
    hypotheses: list[Hypothesis] = field(default_factory=list)
    judgements: list[Judged] = field(default_factory=list)
    expectations: list[Expectation] = field(default_factory=list)
    remediations: list[RemediationRun] = field(default_factory=list)
    slo_windows: list[Any] = field(default_factory=list)  # burn.Counted
    slo_burns: list[Any] = field(default_factory=list)  # burn.Burn


class Evidence:
    """The experiment's connection to the evidence db (pyctl.evidence.store.open_db:
    the same checks as every writer: no symlink, gpufault's or new, 0600)."""

    def __init__(self, db_path: str | os.PathLike[str]) -> None:
        self.path = str(db_path)
        self.db = store.open_db(db_path)
        self.created = bool(getattr(self.db, "gf_created", False))  # a new file
        with self.db.conn:
            self.db.conn.executescript(EXPERIMENT_DDL)
        self.id = ""

    def start(self, exp: Any, host: str) -> str:
        self.id = new_id()
        settings = {"knobs": exp.values, "file": exp.expanded}
        with self.db.conn:
            self.db.conn.execute(
                "INSERT INTO experiments (id, name, version, file, slo_id, started_at, "
                "verdict, reason, settings, host) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    self.id,
                    exp.name,
                    exp.version,
                    str(exp.path),
                    exp.slo_id,
                    time.time(),
                    "running",
                    "running (a row left so means the runner died)",
                    json.dumps(settings, sort_keys=True, default=str),
                    host,
                ),
            )
        return self.id

    def finish(self, verdict: str, reason: str, rec: Record) -> None:
        """All rows and the verdict in one transaction."""
        x = self.id
        c = self.db.conn
        with c:
            c.executemany(
                "INSERT OR REPLACE INTO experiment_steps (experiment_id, idx, name, template, "
                "spec, run_id, planned_start, planned_duration, started_at, ended_at, fires, "
                "status, thread_name) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (
                        x,
                        s.idx,
                        s.name,
                        s.template,
                        json.dumps(s.spec, default=str),
                        s.run_id,
                        s.planned_start,
                        s.planned_duration,
                        s.started_at,
                        s.ended_at,
                        s.fires,
                        s.status,
                        s.thread_name,
                    )
                    for s in rec.steps
                ],
            )
            c.executemany(
                "INSERT INTO probe_samples VALUES (?,?,?,?,?,?,?)",
                [
                    (x, p.probe, p.phase, p.at, int(p.ok), _real(p.value), p.detail)
                    for p in rec.probe_samples
                ],
            )
            c.executemany(
                _LOAD_INSERT,
                [
                    (
                        x,
                        w.start,
                        w.end,
                        w.count,
                        _real(w.p50),
                        _real(w.p95),
                        _real(w.p99),
                        _real(w.error_rate),
                        _real(w.throughput),
                        phase,
                        *(_real(getattr(w, k, None)) for k in STREAMED),
                    )
                    for w, phase in ((lw.window, lw.phase) for lw in rec.load_windows)
                ],
            )
            c.executemany(
                "INSERT INTO hypothesis_results (experiment_id, phase, probe, ok, value, "
                "tolerance, detail, slo_id) VALUES (?,?,?,?,?,?,?,?)",
                [
                    (x, h.phase, h.name, int(h.ok), h.value, h.tolerance, h.detail,
                     h.slo_id or None)
                    for h in rec.hypotheses
                ],  # fmt: skip
            )
            c.executemany(
                "INSERT INTO judgements (experiment_id, metric, baseline_n, window_n, p_value, "
                "effect, worse, reason, slo_id) VALUES (?,?,?,?,?,?,?,?,?)",
                [
                    (
                        x,
                        metric,
                        j.baseline_n,
                        j.window_n,
                        _real(j.p_value),
                        _real(j.effect),
                        int(j.worse),
                        j.reason,
                        sid or None,
                    )
                    for metric, j, sid in (
                        (r.metric, r.judgement, r.slo_id) for r in rec.judgements
                    )
                ],
            )
            c.executemany(
                "INSERT INTO expectations VALUES (?,?,?,?,?)",
                [(x, e.name, int(e.ok), _real(e.value), e.detail) for e in rec.expectations],
            )
            c.executemany(
                "INSERT INTO remediations VALUES (?,?,?,?,?)",
                [(x, r.command, r.started, r.ended, r.rc) for r in rec.remediations],
            )
            c.executemany(
                "INSERT INTO slo_windows VALUES (?,?,?,?,?,?,?)",
                [(x, w.slo_id, w.start, w.end, w.phase, w.total, w.good) for w in rec.slo_windows],
            )
            c.executemany(
                "INSERT INTO slo_burns VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                [
                    (x, b.slo_id, b.alert, b.long_s, b.short_s, b.factor, b.at, b.phase,
                     _real(b.long_burn), _real(b.short_burn), int(b.firing))
                    for b in rec.slo_burns
                ],  # fmt: skip
            )
            c.execute(
                "UPDATE experiments SET ended_at=?, verdict=?, reason=? WHERE id=?",
                (time.time(), verdict, reason, x),
            )

    def close(self) -> None:
        self.db.close()


# ---- reading (experiment results, gpufault show) ----------------------------------------


def _rows(db: Any, sql: str, params: Iterable[Any]) -> list[dict[str, Any]]:
    cur = db.conn.execute(sql, tuple(params))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def has_tables(db: Any) -> bool:
    return bool(
        db.conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name='experiments'"
        ).fetchone()
    )


def results(db: Any, exp_id: str) -> dict[str, Any] | None:
    """One experiment's evidence, as `gpufault experiment results --json` prints it."""
    if not has_tables(db):
        return None
    ex = _rows(db, "SELECT * FROM experiments WHERE id=?", (exp_id,))
    if not ex:
        return None
    e = ex[0]
    e["settings"] = json.loads(e["settings"]) if e["settings"] else None
    steps = _rows(
        db, "SELECT * FROM experiment_steps WHERE experiment_id=? ORDER BY idx", (exp_id,)
    )
    for s in steps:
        s["spec"] = json.loads(s["spec"]) if s["spec"] else None
        s["faults"] = (
            _rows(
                db,
                "SELECT fault_id, function, action, wall, pid, tid, comm FROM faults "
                "WHERE run_id=? ORDER BY seq",
                (s["run_id"],),
            )
            if s["run_id"]
            else []
        )
    q = "SELECT * FROM {} WHERE experiment_id=?"
    out: dict[str, Any] = {"experiment": e, "steps": steps}
    for t in ("hypothesis_results", "judgements", "expectations", "remediations"):
        out[t] = [
            {k: v for k, v in r.items() if k != "experiment_id"}
            for r in _rows(db, q.format(t), (exp_id,))
        ]
    out["load_windows"] = _rows(
        db,
        "SELECT phase, count(*) AS windows, sum(count) AS requests, "
        "max(p99) AS worst_p99 FROM load_windows "
        "WHERE experiment_id=? GROUP BY phase",
        (exp_id,),
    )
    # Each burn-rate SLO's alert pairs ([[slo]]): worst burns, firing windows.
    out["slo_alerts"] = _rows(
        db,
        "SELECT slo_id, alert, factor, max(long_burn) AS worst_long_burn, "
        "max(short_burn) AS worst_short_burn, sum(firing) AS firing_windows, "
        "min(CASE WHEN firing THEN at END) AS first_fired_at FROM slo_burns "
        "WHERE experiment_id=? GROUP BY slo_id, alert ORDER BY slo_id, alert",
        (exp_id,),
    )
    out["probe_samples"] = _rows(
        db,
        "SELECT probe, phase, count(*) AS samples, sum(ok) AS ok "
        "FROM probe_samples WHERE experiment_id=? "
        "GROUP BY probe, phase",
        (exp_id,),
    )
    return out


def experiments(db: Any, limit: int = 50) -> list[dict[str, Any]]:
    if not has_tables(db):
        return []
    return _rows(
        db,
        "SELECT id, name, version, started_at, ended_at, verdict, reason "
        "FROM experiments ORDER BY started_at DESC LIMIT ?",
        (limit,),
    )


def experiment_of_run(db: Any, run_id: str) -> dict[str, Any] | None:
    """The experiment (and step) a fault's run belongs to, for `gpufault show`."""
    if not has_tables(db):
        return None
    rows = _rows(
        db,
        "SELECT e.id, e.name, e.version, e.verdict, s.idx, s.name AS step "
        "FROM experiment_steps s JOIN experiments e ON e.id = s.experiment_id "
        "WHERE s.run_id=?",
        (run_id,),
    )
    return rows[0] if rows else None


__all__ = [
    "EXPERIMENT_DDL",
    "Evidence",
    "Record",
    "results",
    "experiments",
    "experiment_of_run",
    "new_id",
]
