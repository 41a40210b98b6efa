"""The resilience map of an exploration: Markdown, HTML, a diff of two.

Every point with its trials' outcomes, time to recover, one reproduce
command and the evidence (the experiment id); coverage: points tried over
points found, sampled calls covered."""

from __future__ import annotations

import html
import shlex
from pathlib import Path
from typing import Any

from pyctl.report.exploremap import short_function

SEVERITY = {
    "tolerated": 0,
    "degraded within SLO": 1,
    "did not recover": 3,
    "SLO broken": 2,
    "hung": 4,
    "crashed": 5,
    "error": -1,
    "not reached": -2,
}


def coverage(doc: dict[str, Any]) -> dict[str, Any]:
    pts = doc["points"]
    tried = {t["point"] for t in doc["trials"] if t["outcome"] != "not reached"}
    covered: set[str] = set()
    for t in doc["plan"]:
        if t["point"] in tried:
            covered.update(t["covers"])
    calls = sum(p["calls"] or 0 for p in pts)
    calls_cov = sum(p["calls"] or 0 for p in pts if p["point"] in covered)
    return {
        "points_found": len(pts),
        "points_tried": len(covered),
        "trials_planned": len(doc["plan"]),
        "trials_run": len(doc["trials"]),
        "calls_sampled": calls,
        "calls_covered": calls_cov,
        "calls_covered_share": round(calls_cov / calls, 4) if calls else 0.0,
    }


def _site(site: str) -> str:
    obj, _, off = site.rpartition("+")
    return f"{Path(obj).name}+{off}" if obj else site


def _worst(outcomes: list[str]) -> str:
    return max(outcomes, key=lambda o: SEVERITY.get(o, 0)) if outcomes else "not tried"


def rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per point: its trials and its worst outcome."""
    by_point: dict[str, list[dict[str, Any]]] = {}
    plan = {t["idx"]: t for t in doc["plan"]}
    for t in doc["trials"]:
        for p in plan.get(t["idx"], {}).get("covers", [t["point"]]):
            by_point.setdefault(p, []).append(t)
    out = []
    for p in doc["points"]:
        ts = by_point.get(p["point"], [])
        out.append({**p, "trials": ts, "worst": _worst([t["outcome"] for t in ts])})
    return out


def _fault(t: dict[str, Any]) -> str:
    return (
        "hang"
        if t["code"] == "hang"
        else (f"stall {t['code']}" if t["action"] == "stall" else t["code"])
    )


def markdown(doc: dict[str, Any]) -> str:
    e = doc["exploration"]
    dbo = f" --db {shlex.quote(doc['db'])}" if doc.get("db") else ""
    c = coverage(doc)
    out = [
        f"# Exploration {e['id']}: {e['file']}",
        "",
        f"Status **{e['status']}**; {c['points_found']} point(s) found, "
        f"{c['points_tried']} tried ({c['trials_run']} of {c['trials_planned']} trial(s) run); "
        f"{c['calls_covered']} of {c['calls_sampled']} sampled calls covered "
        f"({c['calls_covered_share']:.0%}). Discovery: experiment "
        f"`{e['discover_experiment']}`.",
        "",
        "## Resilience map",
        "",
        "| point | function | caller site | calls | fault | outcome | recover | evidence |",
        "|---|---|---|---:|---|---|---:|---|",
    ]
    for r in rows(doc):
        if not r["trials"]:
            out.append(
                f"| `{r['point']}` | {short_function(r['function'])} | `{_site(r['site'])}` | "
                f"{r['calls']} | | not tried | | |"
            )
        for t in r["trials"]:
            rec = f"{t['recover_s']:.2f}s" if t["recover_s"] is not None else ""
            out.append(
                f"| `{r['point']}` | {short_function(r['function'])} | `{_site(r['site'])}` | "
                f"{r['calls']} | {_fault(t)} | **{t['outcome']}** | {rec} | "
                f"`{t['experiment_id'] or ''}` |"
            )
    out += ["", "## Reproduce", ""]
    for t in doc["trials"]:
        out.append(f"- trial {t['idx']} ({_fault(t)}, {t['outcome']}): `{t['reproduce']}`")
        if t["experiment_id"]:
            out.append(f"  evidence: `gpufault experiment results {t['experiment_id']}{dbo}`")
    out += ["", "## Points", ""]
    for r in rows(doc):
        out.append(
            f"- `{r['point']}` {r['library']}:{r['function']} from "
            f"`{r['site']}`, {r['calls']} calls ({r['rate']}/s); stack: "
            f"{' < '.join(r['stack'][:6])}; a sampled call: "
            f"`gpufault show {r['example_fault']}{dbo}`"
        )
    return "\n".join(out) + "\n"


_CSS = (
    "body{font:14px system-ui,sans-serif;margin:2em;max-width:72em}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px}"
    "th{background:#f3f3f3}code{font-size:12px}"
    ".tolerated{background:#dff5df}.degraded-within-slo{background:#fff4cc}"
    ".slo-broken,.did-not-recover{background:#ffd9cc}.crashed,.hung{background:#f5b5b5}"
    ".not-reached,.error{background:#e8e8e8}"
)


def _cls(o: str) -> str:
    return o.lower().replace(" ", "-")


def html_report(doc: dict[str, Any]) -> str:
    e = doc["exploration"]
    c = coverage(doc)
    h = html.escape
    trs = []
    for r in rows(doc):
        for t in r["trials"] or [None]:
            if t is None:
                trs.append(
                    f"<tr><td><code>{h(r['point'])}</code></td><td>{h(short_function(r['function']))}"
                    f"</td><td><code>{h(_site(r['site']))}</code></td><td>{r['calls']}"
                    "</td><td></td><td>not tried</td><td></td><td></td></tr>"
                )
                continue
            rec = f"{t['recover_s']:.2f}s" if t["recover_s"] is not None else ""
            trs.append(
                f"<tr><td><code>{h(r['point'])}</code></td><td>{h(short_function(r['function']))}</td>"
                f"<td><code title='{h(r['site'])}'>{h(_site(r['site']))}</code></td>"
                f"<td>{r['calls']}</td><td>{h(_fault(t))}</td>"
                f"<td class='{_cls(t['outcome'])}' title='{h(t['reason'] or '')}'>"
                f"{h(t['outcome'])}</td><td>{rec}</td>"
                f"<td><code>{h(t['experiment_id'] or '')}</code><br><code>"
                f"{h(t['reproduce'] or '')}</code></td></tr>"
            )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>gpufault exploration {h(e['id'])}</title><style>{_CSS}</style></head><body>"
        f"<h1>Exploration {h(e['id'])}</h1><p>{h(e['file'])}: status <b>{h(e['status'])}</b>; "
        f"{c['points_found']} point(s) found, {c['points_tried']} tried; "
        f"{c['calls_covered']} of {c['calls_sampled']} sampled calls covered "
        f"({c['calls_covered_share']:.0%}).</p><h2>Resilience map</h2><table><tr>"
        "<th>point</th><th>function</th><th>caller site</th><th>calls</th><th>fault</th>"
        "<th>outcome</th><th>recover</th><th>evidence, reproduce</th></tr>"
        + "".join(trs)
        + "</table></body></html>\n"
    )


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (function, caller site, fault): the outcome in a and in b, where
    they differ or one lacks it. Sites are compared by object name and
    offset (a rebuilt service keeps its offsets only if its code is the same)."""

    def key_map(doc: dict[str, Any]) -> dict[tuple[str, str, str], str]:
        pts = {p["point"]: p for p in doc["points"]}
        out = {}
        for t in doc["trials"]:
            p = pts.get(t["point"], {})
            out[(p.get("function", "?"), _site(p.get("site", "?")), _fault(t))] = t["outcome"]
        for p in doc["points"]:
            out.setdefault((p["function"], _site(p["site"]), ""), "found")
        return out

    ka, kb = key_map(a), key_map(b)
    res = []
    for k in sorted(set(ka) | set(kb)):
        oa, ob = ka.get(k, "absent"), kb.get(k, "absent")
        if oa != ob:
            res.append(
                {
                    "function": k[0],
                    "site": k[1],
                    "fault": k[2],
                    "a": oa,
                    "b": ob,
                    "change": _change(oa, ob),
                }
            )
    return res


# How bad an outcome is for the service, to say which way a change went.
# Outcomes that prove nothing (not reached, error, found, absent) have no
# rank: a change to or from one is "other", never worse or better.
_SEVERITY = {
    "tolerated": 0,
    "degraded within SLO": 1,
    "did not recover": 2,
    "SLO broken": 2,
    "hung": 3,
    "crashed": 3,
}


def _change(a: str, b: str) -> str:
    ra, rb = _SEVERITY.get(a), _SEVERITY.get(b)
    if ra is None or rb is None or ra == rb:
        return "other"
    return "worse" if rb > ra else "better"


def render_diff(a: dict[str, Any], b: dict[str, Any], d: list[dict[str, Any]]) -> str:
    ia, ib = a["exploration"]["id"], b["exploration"]["id"]
    if not d:
        return f"explorations {ia} and {ib}: the same points and outcomes\n"
    lines = [f"{'function':24} {'site':28} {'fault':24} {ia:>18} -> {ib}"]
    for r in d:
        mark = {"worse": "  WORSE", "better": "  better"}.get(r.get("change", ""), "")
        lines.append(
            f"{short_function(r['function'])[:24]:24} {r['site'][:28]:28} {r['fault'][:24]:24} "
            f"{r['a']:>18} -> {r['b']}{mark}"
        )
    worse = [r for r in d if r.get("change") == "worse"]
    better = [r for r in d if r.get("change") == "better"]
    lines.append(
        f"{ib} against {ia}: worse at {len(worse)}, better at {len(better)}, "
        f"other changes {len(d) - len(worse) - len(better)}"
    )
    return "\n".join(lines) + "\n"
