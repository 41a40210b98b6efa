"""A run's evidence in time order: `gpufault timeline RUN`.

Faults, what followed them (error returns, signals, exits: the links
table), NVIDIA Xids and the kernel module's anchors, with the run's start
and end, one event each, in time order, as seconds from the run's start.

Two clocks meet here: runs.started/ended and faults.wall are Unix time,
while faults.ts_ns, links.ts_ns, xids.ts_ns and anchors.mono_ns are
CLOCK_MONOTONIC. A fault row carries both (the engine computes its wall
from its ts_ns), so a run's faults place its monotonic events on the wall
clock; a run without faults has no such pair, and its monotonic events are
then timed from the first of them (the result says so in `notes`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from pyctl.evidence import query, words

WIDTH = 80
# Same-instant events read cause first: the run, the fault, then what followed.
_ORDER = {"run": 0, "fault": 1, "error-return": 2, "signal": 3, "xid": 4, "anchor": 5, "end": 6,
          "exit": 7}  # fmt: skip


# The kind column's words (--json keeps the links' own kinds).
SHORT = {"error-return": "error"}


class TimelineError(Exception):
    """One line, user-facing: no such run or experiment."""


@dataclass
class Event:
    t_s: float  # seconds from the start (the run's, or the experiment's)
    kind: str  # run, fault, error-return, signal, exit, xid, anchor, or a link's kind
    run_id: str
    fault_id: str | None
    text: str
    wall: float | None = None  # Unix time, where known
    ts_ns: int | None = None  # CLOCK_MONOTONIC, where recorded
    rule: str | None = None  # a link's or an Xid's rule
    detail: dict[str, Any] | None = None


@dataclass
class Timeline:
    ref: str  # what was asked for (a run id, latest, an experiment id)
    runs: list[str]
    started: float | None  # Unix time of +0
    experiment: str | None = None
    notes: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _rows(db: Any, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    cur = db.conn.execute(sql, params)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def _json(text: Any) -> Any:
    try:
        return json.loads(text) if text else None
    except (TypeError, ValueError):
        return None


def resolve(db: Any, ref: str) -> tuple[list[str], float | None, str | None]:
    """(run ids, Unix time of +0, experiment id) for a run id, `latest`
    (`last`) or an experiment id (its steps' runs, from its start)."""
    if ref in ("latest", "last"):
        row = db.conn.execute("SELECT run_id FROM runs ORDER BY started DESC LIMIT 1").fetchone()
        if row is None:
            raise TimelineError("no run recorded yet: run gpufault trace or inject first")
        ref = str(row[0])
    try:  # a node's short id (its runs' random half) names its full one
        ref = query.expand_run_id(db, ref)
    except query.AmbiguousId as e:
        raise TimelineError(str(e)) from None
    run = _rows(db, "SELECT run_id, started FROM runs WHERE run_id = ?", (ref,))
    if run:
        return [ref], run[0]["started"], None
    exp = _rows(db, "SELECT id, started_at FROM experiments WHERE id = ?", (ref,))
    if exp:
        steps = _rows(
            db,
            "SELECT run_id FROM experiment_steps WHERE experiment_id = ? AND run_id IS NOT NULL "
            "ORDER BY idx",
            (ref,),
        )
        runs = list(dict.fromkeys(str(s["run_id"]) for s in steps))
        return runs, exp[0]["started_at"], ref
    raise TimelineError(
        f"no run or experiment {ref!r} in this database: give a run id (`gpufault faults`), "
        "an experiment id (`gpufault experiment results`) or `latest`"
    )


# What the BPF engine's faults are carried out by; any other mechanism is a
# layer's (pyctl/evidence/layers.py: tokenizer, hooks, netchaos).
PROBE_MECHANISMS = ("bpf", "regs", "copilot", "signal")


def _fault_text(f: dict[str, Any]) -> str:
    nth = f" #{f['call_seq']}" if f.get("call_seq") is not None else ""
    head = f"{f['function']}{nth} {f['action']}"
    if f.get("mechanism") not in PROBE_MECHANISMS:
        # A layer's fault: its parameters, shortest first (all in --json).
        o = f["outcome"] if isinstance(f.get("outcome"), dict) else {}
        kv = sorted((f"{k}={v}" for k, v in o.items() if not isinstance(v, (dict, list))), key=len)
        return f"{head} via {f.get('mechanism')}" + (": " + " ".join(kv) if kv else "")
    said = words.outcome_words(f)
    if f["action"] == "fail" and not any("NOT injected" in s for s in said):
        return f"{head}: {words.code_name(f['function'], f['library'], f['retval'])}"
    if said:
        # The copilot's phrase already says what it injected: keep the rest short.
        return f"{head}: " + "; ".join(s.removeprefix("copilot: ") for s in said)
    return head


def _run_events(db: Any, run_id: str) -> tuple[list[Event], float | None, list[str]]:
    """A run's events with `wall` set where it can be (t_s filled later),
    the offset wall - mono (None: no fault to tell it), notes."""
    notes: list[str] = []
    (run,) = _rows(db, "SELECT * FROM runs WHERE run_id = ?", (run_id,))
    faults = _rows(db, "SELECT * FROM faults WHERE run_id = ? ORDER BY seq", (run_id,))
    offset = next((f["wall"] - f["ts_ns"] / 1e9 for f in faults if f["wall"] and f["ts_ns"]), None)
    out: list[Event] = []
    argv = _json(run.get("argv"))
    cmd = " ".join(argv) if isinstance(argv, list) else (run.get("argv") or "")
    out.append(Event(0.0, "run", run_id, None, f"run {run_id} started: {cmd}",
                     wall=run.get("started")))  # fmt: skip
    for f in faults:
        f["outcome"] = _json(f.get("outcome"))
        out.append(Event(0.0, "fault", run_id, f["fault_id"], _fault_text(f), wall=f["wall"],
                         ts_ns=f["ts_ns"], detail={"outcome": f["outcome"]}))  # fmt: skip
        if f.get("mechanism") not in PROBE_MECHANISMS and f.get("wall") and f.get("latency_ns"):
            # A layer's window (VRAM held, a partition) starts at wall and
            # lasts latency_ns: its end is an event too.
            end = f["wall"] + f["latency_ns"] / 1e9
            out.append(Event(0.0, "end", run_id, f["fault_id"],
                             f"{f['function']} {f['action']} ended after "
                             f"{words.duration_ns(f['latency_ns'])}", wall=end))  # fmt: skip
    names = {
        r["func"]: r
        for r in _rows(db, "SELECT func, symbol, library FROM funcs WHERE run_id = ?", (run_id,))
    }
    for link in _rows(db, "SELECT * FROM links WHERE run_id = ? ORDER BY ts_ns, id", (run_id,)):
        link["detail"] = _json(link.get("detail"))
        d = link["detail"] if isinstance(link["detail"], dict) else {}
        if link["kind"] == "error-return" and d.get("func") in names:
            link["function"] = names[d["func"]]["symbol"]
            link["library"] = names[d["func"]]["library"]
        text = words.link_words(link, brief=True)
        if link["fault_id"] is None:
            text = "unattributed: " + text
        out.append(Event(0.0, link["kind"], run_id, link["fault_id"], text, ts_ns=link["ts_ns"],
                         rule=link["rule"], detail=link["detail"]))  # fmt: skip
    for x in _rows(db, "SELECT * FROM xids WHERE run_id = ? ORDER BY ts_ns, id", (run_id,)):
        out.append(Event(0.0, "xid", run_id, x["fault_id"],
                         f"{x['error_code']} on {x['dev']}: {x['msg']}", ts_ns=x["ts_ns"],
                         rule=x["rule"]))  # fmt: skip
    # anchors.run_id is the kernel module's own number: a run's anchors are
    # the ones naming its faults.
    for a in _rows(
        db,
        "SELECT id, fault_id, kind, bdf, code, mono_ns, wall_ns, rec_seq FROM anchors "
        "WHERE fault_id IN (SELECT fault_id FROM faults WHERE run_id = ?) ORDER BY mono_ns, id",
        (run_id,),
    ):
        out.append(Event(0.0, "anchor", run_id, a["fault_id"],
                         f"{a['kind']} on {a['bdf'] or '-'} code {a['code']} "
                         f"(record {a['rec_seq']})", ts_ns=a["mono_ns"],
                         wall=a["wall_ns"] / 1e9 if a["wall_ns"] else None))  # fmt: skip
    if run.get("ended"):
        how = f"run {run_id} ended: {run.get('status')}"
        if run.get("exit_code") is not None:
            how += f" (exit {run['exit_code']})"
        out.append(Event(0.0, "run", run_id, None, how, wall=run["ended"]))
    else:
        out.append(Event(0.0, "run", run_id, None, f"run {run_id}: {run.get('status')}, no end "
                         "recorded", wall=None))  # fmt: skip
    if offset is None and any(e.ts_ns is not None and e.wall is None for e in out):
        notes.append(
            f"run {run_id} has no fault to place the monotonic clock on the wall clock: "
            "its links, Xids and anchors are timed from the first of them"
        )
    return out, offset, notes


def build(db: Any, ref: str) -> Timeline:
    runs, started, exp = resolve(db, ref)
    tl = Timeline(ref=ref, runs=runs, started=started, experiment=exp)
    for run_id in runs:
        events, offset, notes = _run_events(db, run_id)
        tl.notes.extend(notes)
        mono = [e.ts_ns for e in events if e.ts_ns is not None]
        first_mono = min(mono) if mono else 0
        for e in events:
            if e.ts_ns is not None and offset is not None:
                e.wall = e.wall if e.kind == "fault" else offset + e.ts_ns / 1e9
            if e.wall is not None and started is not None:
                e.t_s = e.wall - started
            elif e.ts_ns is not None:
                e.t_s = (e.ts_ns - first_mono) / 1e9
            else:
                e.t_s = float("inf")  # no time known: last
        tl.events.extend(events)
    tl.events.sort(key=lambda e: (e.t_s, _ORDER.get(e.kind, 9), e.ts_ns or 0))
    for e in tl.events:
        if e.t_s == float("inf"):
            e.t_s = None  # type: ignore[assignment]  # JSON has no infinity
    return tl


def _fit(line: str, width: int | None) -> str:
    if width is None or len(line) <= width:
        return line
    return line[: width - 3] + "..."


def render(tl: Timeline, width: int | None = WIDTH) -> str:
    """One line an event, `width` columns (a terminal); width None: every
    line whole (a file or a pipe, as `faults` does). --json has the whole
    text too."""
    head = f"timeline of {'experiment ' + tl.experiment if tl.experiment else 'run'} "
    head += ", ".join(tl.runs) if tl.runs else "(no runs)"
    if tl.started is not None:
        head += f", +0 = {words.wall_time(tl.started)}"
    out = [_fit(head, width)]
    for n in tl.notes:
        out.append(_fit(f"  note: {n}", width))
    fw = max([10, *(len(e.fault_id or "") for e in tl.events)])
    times = ["? s" if e.t_s is None else f"{e.t_s:+.3f} s" for e in tl.events]
    tw = max([8, *map(len, times)])
    for t, e in zip(times, tl.events, strict=True):
        kind = SHORT.get(e.kind, e.kind)
        out.append(_fit(f"{t:>{tw}} {kind:7} {e.fault_id or '':{fw}}  {e.text}", width))
    return "\n".join(out)
