"""What the HTML and the Markdown report share: cell texts, the matrix."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyctl.observe.names import fire_code, short_function
from pyctl.report.data import ExperimentData
from pyctl.symbols.demangle import demangle

MATRIX_COLUMNS = (
    ("alert_fired", "alert fired"),
    ("degradation_worked", "degradation worked"),
    ("recovered_within", "recovered within N"),
)


def overrides_text(d: ExperimentData) -> str:
    """`set k=v ...` (its --set values), or "" (the file's defaults)."""
    o = d.overrides()
    return ("set " + " ".join(f"{k}={v}" for k, v in sorted(o.items()))) if o else ""


def utc(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def rel(t: float | None, t0: float) -> str:
    return "-" if t is None else f"+{t - t0:.2f} s"


def secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s" if v < 10 else f"{v:.1f} s"


@dataclass(frozen=True)
class Cell:
    state: str  # pass | fail | unset
    text: str
    title: str


LINKED = ("linked", "evidence linked")  # a column only where an experiment asserts it


def matrix_columns(ds: Sequence[ExperimentData]) -> tuple[tuple[str, str], ...]:
    """The handbook's three columns, and `evidence linked` when any of the
    experiments asserts `linked` (an Xid or anchor naming its fault)."""
    if any(k.startswith("linked:") for d in ds for k in d.expectations):
        return (*MATRIX_COLUMNS, LINKED)
    return MATRIX_COLUMNS


def _linked_cell(d: ExperimentData) -> Cell:
    es = {k.split(":", 1)[1]: e for k, e in d.expectations.items() if k.startswith("linked:")}
    if not es:
        return Cell("unset", "not asserted", "the experiment does not assert this")
    ok = all(e.get("ok") for e in es.values())
    text = ", ".join(f"{w} {'yes' if e.get('ok') else 'no'}" for w, e in sorted(es.items()))
    return Cell(
        "pass" if ok else "fail", text, "; ".join(e.get("detail") or "" for e in es.values())
    )


def matrix_cell(d: ExperimentData, name: str) -> Cell:
    if name == LINKED[0]:
        return _linked_cell(d)
    e = d.expectations.get(name)
    if e is None:
        return Cell("unset", "not asserted", "the experiment does not assert this")
    ok = e.get("ok")
    state = "unset" if ok is None else "pass" if ok else "fail"
    v = e.get("value")
    detail = e.get("detail") or ""
    if name == "recovered_within":
        lim = d.recovery_limit_s()
        lim_t = f" (N = {lim:g} s)" if lim is not None else ""
        text = f"{secs(v)}{lim_t}" if v is not None else f"never{lim_t}"
    elif name == "alert_fired":
        text = f"after {secs(v)}" if v is not None else ("yes" if ok else "no")
    else:
        # The runner stores the share of degradation-probe samples that were ok.
        share = f" ({100 * v:.0f} % of samples)" if isinstance(v, int | float) else ""
        text = ("yes" if ok else "no" if ok is not None else "-") + share
    return Cell(state, text, detail)


def code_of(f: dict[str, Any]) -> str:
    return fire_code(f)


def function_of(f: dict[str, Any]) -> tuple[str, str]:
    """(short name to show, full demangled name for the tooltip)."""
    name = str(f.get("function") or "?")
    return short_function(name), demangle(name)


def spec_text(st: dict[str, Any], limit: int = 160) -> str:
    """What a step injects: the runner's `describe` lines of its spec (the
    text `gpufault inject` prints), after the template's name if any."""
    raw = st.get("spec")
    desc = ""
    if raw:
        try:
            d = json.loads(raw)
        except ValueError:
            d = raw
        if isinstance(d, dict) and d.get("describe"):
            desc = "; ".join(str(x) for x in d["describe"])
        elif isinstance(d, dict):
            f: dict[str, Any] = d["fault"] if isinstance(d.get("fault"), dict) else d
            desc = " ".join(f"{k}={v}" for k, v in f.items() if v not in (None, "", {}, []))
        else:
            desc = str(d)
    text = ": ".join(x for x in (st.get("template") or "", desc) if x) or "-"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def hypothesis_grid(d: ExperimentData) -> list[tuple[str, str, dict[str, dict[str, Any]]]]:
    """[(probe, tolerance, {phase: row})] in first-seen order."""
    out: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {}
    for r in d.hypothesis:
        tol, phases = out.setdefault(r["probe"], (r.get("tolerance") or "", {}))
        phases[r.get("phase") or ""] = r
    return [(p, tol, ph) for p, (tol, ph) in out.items()]


FULL_CHAINS = 3  # chains printed whole per experiment, besides those with something linked


def full_chains(chains: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chains worth printing whole: the first few (one fault of a
    hundred fires reads like the rest) and every one an Xid, anchor or link
    followed; the table lists them all."""
    return [c for i, c in enumerate(chains) if i < FULL_CHAINS or linked(c)]


def linked(chain: dict[str, Any]) -> list[str]:
    """What followed a fault, one short line each (Xids, anchors, links)."""
    out = []
    for x in chain.get("xids") or []:
        out.append(f"Xid {x.get('error_code')} on {x.get('dev')}: {x.get('msg')} [{x.get('rule')}]")
    for a in chain.get("anchors") or []:
        out.append(f"anchor {a.get('kind')} {a.get('bdf')} [record {a.get('rec_seq')}]")
    for ln in chain.get("links") or []:
        out.append(f"{ln.get('kind')} {json.dumps(ln.get('detail'))} [{ln.get('rule')}]")
    return out


def step_thread(st: dict[str, Any]) -> str:
    """Which thread a step went to, by the target's own name for it
    (experiment_steps.thread_name, read from /proc/PID/task/TID/comm when it
    armed) and its tid; "all" when the step had the whole process."""
    tid = None
    raw = st.get("spec")
    if raw:
        try:
            spec = json.loads(raw)
        except ValueError:
            spec = None
        if isinstance(spec, dict):
            tid = spec.get("tid")
    name = st.get("thread_name")
    if tid and name:
        return f"{name} (tid {tid})"
    return str(name) if name else (f"tid {tid}" if tid else "all")


def fault_thread(f: dict[str, Any]) -> str:
    """The thread a fault fired on, with the name the target gave it (the
    comm the probe read at the fire)."""
    who = f"pid {f.get('pid')} tid {f.get('tid')}"
    return f"{who} ({f.get('comm')})" if f.get("comm") else who
