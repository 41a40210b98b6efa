"""The report as one self-contained HTML file: inline CSS and inline SVG,
no script, no font, image or style sheet fetched from anywhere (a report
is opened offline, attached to a ticket, or archived)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from pyctl.evidence import query
from pyctl.report import common
from pyctl.report.data import ExperimentData, load
from pyctl.report.exploremap import ExploreMap, map_html
from pyctl.report.svg import timeline
from pyctl.report.svg_load import load_panels

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Liberation Sans",sans-serif;
 color:#212529;margin:0;background:#f8f9fa}
main{max-width:1120px;margin:0 auto;padding:20px 20px 60px}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:18px;margin:32px 0 8px;
 border-bottom:2px solid #dee2e6;padding-bottom:4px}h3{font-size:15px;margin:18px 0 6px}
.sub{color:#6c757d;margin:0 0 12px}
section.experiment{background:#fff;border:1px solid #dee2e6;border-radius:6px;
 padding:4px 18px 18px;margin:22px 0}
table{border-collapse:collapse;margin:6px 0 10px;font-size:13px}
th,td{border:1px solid #dee2e6;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f1f3f5;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.pass{background:#d3f9d8;color:#1b5e20}.fail{background:#ffe3e3;color:#a51111}
.unset{background:#f1f3f5;color:#6c757d}.aborted,.error{background:#fff3bf;color:#7a4d00}
.badge{display:inline-block;padding:1px 10px;border-radius:10px;font-weight:700;
 text-transform:uppercase;font-size:12px;letter-spacing:.04em}
table.matrix td.cell{text-align:center;min-width:110px;font-weight:600}
table.matrix .sets code{white-space:normal;overflow-wrap:anywhere}
dl.facts{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0}
dl.facts dt{color:#6c757d}dl.facts dd{margin:0}
.plot{overflow-x:auto;margin:8px 0}
details{margin:4px 0}summary{cursor:pointer}
pre{background:#f1f3f5;padding:8px;border-radius:4px;overflow-x:auto;font-size:12px}
code{font-size:12px;white-space:nowrap}
table.chains{width:100%}td.nowrap{white-space:nowrap}
.muted{color:#868e96}
@media print{body{background:#fff}section.experiment{border:none;padding:0}}
"""


def _badge(verdict: str | None) -> str:
    v = verdict or "unknown"
    return f'<span class="badge {escape(v)}">{escape(v)}</span>'


def _ok(ok: Any) -> str:
    if ok is None:
        return '<td class="unset">-</td>'
    return '<td class="pass">✓ ok</td>' if ok else '<td class="fail">✗ no</td>'


def _table(head: Sequence[str], rows: list[list[str]], cls: str = "") -> str:
    """rows hold cells already rendered as <td>...</td>."""
    h = "".join(f"<th>{escape(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def _td(v: Any, cls: str = "") -> str:
    c = f' class="{cls}"' if cls else ""
    return f"<td{c}>{escape('-' if v is None else str(v))}</td>"


def matrix_html(ds: Sequence[ExperimentData]) -> str:
    cols = common.matrix_columns(ds)
    rows = []
    for d in ds:
        sets = common.overrides_text(d)
        cells = [
            f'<td><a href="#exp-{escape(d.id)}">{escape(d.name)}</a>'
            f'<div class="muted">{escape(d.id)}</div>'
            + (f'<div class="muted sets"><code>{escape(sets)}</code></div>' if sets else "")
            + "</td>",
            f"<td>{escape(d.exp.get('slo_id') or '-')}</td>",
        ]
        for key, _label in cols:
            c = common.matrix_cell(d, key)
            mark = {"pass": "✓", "fail": "✗", "unset": "–"}[c.state]
            cells.append(
                f'<td class="cell {c.state}" data-expectation="{key}" '
                f'title="{escape(c.title)}">{mark} {escape(c.text)}</td>'
            )
        cells.append(f"<td>{_badge(d.exp.get('verdict'))}</td>")
        rows.append(cells)
    return _table(
        ["experiment", "slo_id", *(lab for _k, lab in cols), "verdict"],
        rows,
        "matrix",
    )


def _facts(d: ExperimentData) -> str:
    e = d.exp
    t0 = d.t0
    facts = [
        ("id", e["id"]),
        ("file", f"{e.get('file') or '-'} (version {e.get('version')})"),
        ("slo_id", e.get("slo_id") or "-"),
        ("host", e.get("host") or "-"),
        ("started", common.utc(e.get("started_at"))),
        ("duration", common.secs((e.get("ended_at") or d.t1) - t0)),
        ("reason", e.get("reason") or "-"),
        ("faults fired", f"{len(d.faults)} in {len(d.steps)} step(s)"),
        ("faults ended", common.rel(d.faults_ended, t0)),
        (
            "recovery time",
            (
                f"{common.secs(d.recovery_s())} after the faults ended"
                if d.recovery_s() is not None
                else "not recovered"
                if "recovered_within" in d.expectations
                else "-"
            ),
        ),
    ]
    return (
        '<dl class="facts">'
        + "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in facts)
        + "</dl>"
    )


def _steps(d: ExperimentData) -> str:
    if not d.steps:
        return '<p class="muted">no fault step (a control experiment)</p>'
    rows = []
    for st in d.steps:
        rows.append(
            [
                _td(st["idx"] + 1, "num"),  # step 1 is the first, as the CLI says
                _td(st.get("name")),
                _td(common.spec_text(st)),
                _td(st.get("run_id")),
                _td(common.rel(st.get("planned_start"), d.t0), "nowrap"),
                _td(common.secs(st.get("planned_duration")), "nowrap"),
                _td(common.rel(st.get("started_at"), d.t0), "nowrap"),
                _td(common.rel(st.get("ended_at"), d.t0), "nowrap"),
                _td(common.step_thread(st), "nowrap"),
                _td(st.get("fires"), "num"),
                _td(st.get("status")),
            ]
        )
    return _table(
        ["#", "step", "fault", "run", "planned", "for", "started", "ended", "thread", "fires",
         "status"],
        rows,
    )  # fmt: skip


def _load_panels(d: ExperimentData) -> str:
    svg = load_panels(d)
    out = f"<h3>Throughput and token latency</h3><div class=\"plot\">{svg}</div>" if svg else ""
    rows = []
    for r in d.burn_summary():
        fired = (
            f"+{r['fired_at'] - d.t0:.1f} s ({r['fired_phase']}), {r['firing_windows']} windows"
            if r["fired_at"] is not None
            else "never"
        )
        rows.append([_td(r["slo_id"]), _td(r["alert"]), _td(f"{r['long']:.3g}x", "num"),
                     _td(f"{r['short']:.3g}x", "num"), _td(fired)])  # fmt: skip
    if rows:
        out += "<h3>Burn-rate SLOs</h3>" + _table(
            ["slo_id", "alert", "worst long burn", "worst short burn", "fired"], rows
        )
    return out


def _hypothesis(d: ExperimentData) -> str:
    grid = common.hypothesis_grid(d)
    if not grid:
        return '<p class="muted">no steady-state hypothesis recorded</p>'
    rows = []
    for probe, tol, phases in grid:
        r = [_td(probe), _td(tol)]
        for ph in ("before", "during", "after"):
            row = phases.get(ph)
            if row is None:
                r.append('<td class="unset">-</td>')
                continue
            cls = "unset" if row.get("ok") is None else "pass" if row["ok"] else "fail"
            mark = {"pass": "✓", "fail": "✗", "unset": "–"}[cls]
            title = f' title="{escape(row.get("detail") or "")}"' if row.get("detail") else ""
            r.append(f'<td class="{cls}"{title}>{mark} {escape(str(row.get("value") or ""))}</td>')
        rows.append(r)
    return _table(["probe", "tolerance", "before", "during", "after"], rows, "hypothesis")


def _judgements(d: ExperimentData) -> str:
    if not d.judgements:
        return '<p class="muted">no statistics recorded</p>'
    rows = []
    for j in d.judgements:
        p = j.get("p_value")
        rows.append(
            [
                _td(j.get("metric")),
                _td(j.get("baseline_n"), "num"),
                _td(j.get("window_n"), "num"),
                _td(None if p is None else f"{p:.3g}", "num"),
                _td(None if j.get("effect") is None else f"{j['effect']:.3g}", "num"),
                (
                    _ok(None)
                    if j.get("worse") is None
                    else '<td class="fail">worse</td>'
                    if j["worse"]
                    else '<td class="pass">not worse</td>'
                ),
                _td(j.get("reason")),
            ]
        )
    return _table(
        ["metric", "baseline n", "window n", "p", "effect", "judged", "reason"],
        rows,
        "judgements",
    )


def _expectations(d: ExperimentData) -> str:
    if not d.expectations:
        return '<p class="muted">no expectations asserted</p>'
    rows = [
        [
            _td(e["name"]),
            _ok(e.get("ok")),
            _td(None if e.get("value") is None else f"{e['value']:.3g}", "num"),
            _td(e.get("detail")),
        ]
        for e in d.expectations.values()
    ]
    return _table(["expectation", "held", "value", "detail"], rows)


def _remediations(d: ExperimentData) -> str:
    if not d.remediations:
        return ""
    rows = []
    for r in d.remediations:
        took = (
            None
            if r.get("ended_at") is None or r.get("started_at") is None
            else r["ended_at"] - r["started_at"]
        )
        rows.append(
            [
                _td(r.get("command")),
                _td(common.rel(r.get("started_at"), d.t0)),
                _td(common.secs(took), "num"),
                _td(r.get("rc"), "num"),
            ]
        )
    return "<h3>Remediation</h3>" + _table(["command", "started", "took", "rc"], rows)


def _fn_td(f: dict[str, Any]) -> str:
    short, full = common.function_of(f)
    return f'<td class="nowrap" title="{escape(full)}">{escape(short)}</td>'


def _chains(d: ExperimentData) -> str:
    if not d.chains:
        return '<p class="muted">no fault fired in this experiment</p>'
    rows = []
    for c in d.chains:
        f = c["fault"]
        follow = common.linked(c)
        rows.append(
            [
                f"<td><code>{escape(f['fault_id'])}</code></td>",
                _fn_td(f),
                _td(common.code_of(f), "nowrap"),
                _td(f.get("action")),
                _td(common.fault_thread(f), "nowrap"),
                _td(common.rel(f.get("wall"), d.t0), "nowrap"),
                "<td>"
                + (
                    "<br>".join(escape(x) for x in follow)
                    or '<span class="muted">nothing linked</span>'
                )
                + "</td>",
            ]
        )
    out = [
        _table(
            ["fault id", "function", "code", "action", "thread", "time", "linked"], rows, "chains"
        )
    ]
    full = common.full_chains(d.chains)
    for c in full:
        out.append(
            f"<details><summary>chain of <code>{escape(c['fault']['fault_id'])}</code>"
            f"</summary><pre>{escape(query.render_chain(c))}</pre></details>"
        )
    if len(full) < len(d.chains):
        out.append(
            f'<p class="muted">the other {len(d.chains) - len(full)} chains: '
            "<code>gpufault show FAULT_ID</code></p>"
        )
    if d.chains_left_out:
        out.append(
            f'<p class="muted">{d.chains_left_out} more faults: '
            f"<code>gpufault experiment results {escape(d.id)}</code> lists them all</p>"
        )
    return "".join(out)


def experiment_html(d: ExperimentData) -> str:
    return (
        f'<section class="experiment" id="exp-{escape(d.id)}">'
        f"<h2>{escape(d.name)} {_badge(d.exp.get('verdict'))}</h2>"
        + _facts(d)
        + "<h3>Timeline</h3>"
        + f'<div class="plot">{timeline(d)}</div>'
        + _load_panels(d)
        + "<h3>Fault steps</h3>"
        + _steps(d)
        + "<h3>Steady-state hypothesis</h3>"
        + _hypothesis(d)
        + "<h3>Statistics (fault window against the baseline)</h3>"
        + _judgements(d)
        + "<h3>Expectations</h3>"
        + _expectations(d)
        + _remediations(d)
        + "<h3>Evidence chains</h3>"
        + _chains(d)
        + "</section>"
    )


def render_datas(
    ds: Sequence[ExperimentData],
    title: str | None = None,
    maps: Sequence[ExploreMap] = (),
) -> str:
    """maps: explorations whose resilience map goes before the matrix
    (their trials' experiments are among ds)."""
    title = title or ("gpufault experiment report: " + ", ".join(d.name for d in ds))
    gen = common.utc(max((d.t1 for d in ds), default=None))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body><main>"
        f"<h1>{escape(title)}</h1>"
        f'<p class="sub">{len(ds)} experiment(s); last one ended {escape(gen)}; '
        "written by gpufault from its evidence database</p>"
        + "".join(map_html(m) for m in maps)
        + "<h2>Verification matrix</h2>"
        + matrix_html(ds)
        + "".join(experiment_html(d) for d in ds)
        + "</main></body></html>\n"
    )


def render_html(db: Any, experiment_ids: Sequence[str], title: str | None = None) -> str:
    return render_datas([load(db, i) for i in experiment_ids], title)
