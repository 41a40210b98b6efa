"""The report as Markdown (GitHub-flavoured tables): the same sections as
the HTML one but the plot, which it summarises in a line per phase."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyctl.evidence import query
from pyctl.report import common
from pyctl.report.data import ExperimentData, load
from pyctl.report.exploremap import ExploreMap, map_md

MARK = {"pass": "✓", "fail": "✗", "unset": "–"}


def _cell(v: Any) -> str:
    s = "-" if v is None else str(v)
    return s.replace("|", "\\|").replace("\n", " ")


def _table(head: Sequence[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return out + [""]


def matrix_md(ds: Sequence[ExperimentData]) -> list[str]:
    cols = common.matrix_columns(ds)
    rows = []
    for d in ds:
        sets = common.overrides_text(d)
        name = f"{d.name} (`{d.id}`)" + (f" `{sets}`" if sets else "")
        cells: list[Any] = [name, d.exp.get("slo_id") or "-"]
        for key, _lab in cols:
            c = common.matrix_cell(d, key)
            cells.append(f"{MARK[c.state]} {c.text}")
        cells.append(f"**{d.exp.get('verdict') or 'unknown'}**")
        rows.append(cells)
    return _table(["experiment", "slo_id", *(lab for _k, lab in cols), "verdict"], rows)


def _phase_summary(d: ExperimentData) -> list[list[Any]]:
    by: dict[str, list[dict[str, Any]]] = {}
    for w in d.windows:
        by.setdefault(w.get("phase") or "-", []).append(w)
    rows = []
    for ph, ws in by.items():
        p50 = [w["p50"] for w in ws if w.get("p50") is not None]
        p99 = [w["p99"] for w in ws if w.get("p99") is not None]
        er = [w.get("error_rate") or 0 for w in ws]
        rows.append(
            [
                ph,
                f"{common.rel(ws[0]['start'], d.t0)} .. {common.rel(ws[-1]['end'], d.t0)}",
                f"{1000 * sorted(p50)[len(p50) // 2]:.1f} ms" if p50 else "-",
                f"{1000 * max(p99):.1f} ms" if p99 else "-",
                f"{100 * max(er):.1f} %" if er else "-",
            ]
        )
    return rows


def _med(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _tokens(d: ExperimentData) -> list[str]:
    """Throughput and, for a streamed load, TTFT/ITL by phase; the token
    bounds and the windows that broke them (the HTML's panels, in words)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for w in d.windows:
        by.setdefault(w.get("phase") or "-", []).append(w)
    streamed = any(w.get("itl_p99") is not None or w.get("ttft_p99") is not None
                   for w in d.windows)  # fmt: skip
    if not by:
        return []

    def ms(ws: list[dict[str, Any]], k: str, f: Any) -> str:
        v = [w[k] for w in ws if w.get(k) is not None]
        return f"{1000 * f(v):.1f} ms" if v else "-"

    def rate(ws: list[dict[str, Any]], k: str) -> str:
        v = [w[k] for w in ws if w.get(k) is not None]
        return f"{_med(v):.1f}/s" if v else "-"

    rows = []
    for ph, ws in by.items():
        r = [ph, rate(ws, "throughput"), rate(ws, "output_tokens_per_s")]
        if streamed:
            r += [ms(ws, "ttft_p50", _med), ms(ws, "ttft_p99", max), ms(ws, "itl_p50", _med),
                  ms(ws, "itl_p99", max)]  # fmt: skip
        rows.append(r)
    head = ["phase", "answers", "output tokens"]
    if streamed:
        head += ["TTFT p50", "worst TTFT p99", "ITL p50", "worst ITL p99"]
    out = ["### Throughput and token latency by phase (medians, worst p99)", ""]
    out += _table(head, rows)
    bounds = d.token_bounds()
    if bounds:
        words = [
            f"{k} {op} {1000 * v:g} ms" if k.startswith(("ttft", "itl")) else f"{k} {op} {v:g}/s"
            for k, (op, v) in bounds.items()
        ]
        breached = [(w, why) for w in d.windows if (why := d.token_breaches(w))]
        out.append(f"- token SLO per 1 s window: {', '.join(words)}; "
                   f"{len(breached)} of {len(d.windows)} windows broke it")  # fmt: skip
        for w, why in breached[:20]:
            out.append(f"  - {common.rel(w['start'], d.t0)} ({w.get('phase')}): {'; '.join(why)}")
        if len(breached) > 20:
            out.append(f"  - {len(breached) - 20} more")
        out.append("")
    return out


def _burns(d: ExperimentData) -> list[str]:
    rows = []
    for r in d.burn_summary():
        fired = (
            f"+{r['fired_at'] - d.t0:.1f} s ({r['fired_phase']}), {r['firing_windows']} windows"
            if r["fired_at"] is not None
            else "never"
        )
        rows.append([f"`{r['slo_id']}`", r["alert"], f"{r['long']:.3g}x", f"{r['short']:.3g}x",
                     fired])  # fmt: skip
    if not rows:
        return []
    return ["### Burn-rate SLOs", ""] + _table(
        ["slo_id", "alert", "worst long burn", "worst short burn", "fired"], rows
    )


def experiment_md(d: ExperimentData) -> list[str]:
    e = d.exp
    rec = d.recovery_s()
    out = [
        f"## {d.name}: {e.get('verdict') or 'unknown'}",
        "",
        f"- id `{d.id}`, file `{e.get('file') or '-'}` (version {e.get('version')}), "
        f"slo_id `{e.get('slo_id') or '-'}`, host {e.get('host') or '-'}",
        f"- started {common.utc(e.get('started_at'))}, "
        f"duration {common.secs((e.get('ended_at') or d.t1) - d.t0)}",
        f"- reason: {e.get('reason') or '-'}",
        f"- {len(d.faults)} faults fired in {len(d.steps)} step(s); faults ended "
        f"{common.rel(d.faults_ended, d.t0)}; recovery time "
        + (f"{common.secs(rec)}" if rec is not None else "-"),
        "",
    ]
    bounds = d.slo_bounds()
    if bounds:
        words = [f"{k} <= {1000 * v:g} ms" for k, v in bounds.items() if k != "error_rate"]
        if "error_rate" in bounds:
            words.append(f"errors <= {100 * bounds['error_rate']:g} %")
        breached = [(w, d.breaches(w)) for w in d.windows]
        breached = [(w, why) for w, why in breached if why]
        out.append(f"- SLO per 1 s window: {', '.join(words)}; "
                   f"{len(breached)} of {len(d.windows)} windows broke it")  # fmt: skip
        for w, why in breached[:20]:
            out.append(f"  - {common.rel(w['start'], d.t0)} ({w.get('phase')}): {'; '.join(why)}")
        if len(breached) > 20:
            out.append(f"  - {len(breached) - 20} more")
        out.append("")
    out += ["### Load by phase (median p50, worst p99, worst error rate)", ""]
    out += _table(["phase", "window", "p50", "p99", "errors"], _phase_summary(d))
    out += _tokens(d)
    out += _burns(d)
    out += ["### Fault steps", ""]
    out += _table(
        ["#", "step", "fault", "run", "started", "ended", "thread", "fires", "status"],
        [
            [
                st["idx"] + 1,  # step 1 is the first, as the CLI says
                st.get("name"),
                common.spec_text(st),
                st.get("run_id"),
                common.rel(st.get("started_at"), d.t0),
                common.rel(st.get("ended_at"), d.t0),
                common.step_thread(st),
                st.get("fires"),
                st.get("status"),
            ]
            for st in d.steps
        ],
    )
    out += ["### Steady-state hypothesis", ""]
    rows = []
    for probe, tol, phases in common.hypothesis_grid(d):
        r: list[Any] = [probe, tol]
        for ph in ("before", "during", "after"):
            row = phases.get(ph)
            if row is None:
                r.append("-")
            else:
                st = "unset" if row.get("ok") is None else "pass" if row["ok"] else "fail"
                r.append(f"{MARK[st]} {row.get('value') or ''}")
        rows.append(r)
    out += _table(["probe", "tolerance", "before", "during", "after"], rows)
    out += ["### Statistics", ""]
    out += _table(
        ["metric", "baseline n", "window n", "p", "effect", "judged", "reason"],
        [
            [
                j.get("metric"),
                j.get("baseline_n"),
                j.get("window_n"),
                None if j.get("p_value") is None else f"{j['p_value']:.3g}",
                None if j.get("effect") is None else f"{j['effect']:.3g}",
                "-" if j.get("worse") is None else "worse" if j["worse"] else "not worse",
                j.get("reason"),
            ]
            for j in d.judgements
        ],
    )
    out += ["### Expectations", ""]
    out += _table(
        ["expectation", "held", "value", "detail"],
        [
            [
                x["name"],
                "-" if x.get("ok") is None else "yes" if x["ok"] else "no",
                x.get("value"),
                x.get("detail"),
            ]
            for x in d.expectations.values()
        ],
    )
    if d.remediations:
        out += ["### Remediation", ""]
        out += _table(
            ["command", "started", "ended", "rc"],
            [
                [
                    r.get("command"),
                    common.rel(r.get("started_at"), d.t0),
                    common.rel(r.get("ended_at"), d.t0),
                    r.get("rc"),
                ]
                for r in d.remediations
            ],
        )
    out += ["### Evidence chains", ""]
    out += _table(
        ["fault id", "function", "code", "action", "thread", "time", "linked"],
        [
            [
                f"`{c['fault']['fault_id']}`",
                common.function_of(c["fault"])[0],
                common.code_of(c["fault"]),
                c["fault"].get("action"),
                common.fault_thread(c["fault"]),
                common.rel(c["fault"].get("wall"), d.t0),
                "; ".join(common.linked(c)) or "nothing linked",
            ]
            for c in d.chains
        ],
    )
    full = common.full_chains(d.chains)
    for c in full:
        out += ["```", query.render_chain(c), "```", ""]
    if len(full) < len(d.chains):
        out += [f"The other {len(d.chains) - len(full)} chains: `gpufault show FAULT_ID`.", ""]
    if d.chains_left_out:
        out += [
            f"{d.chains_left_out} more faults: `gpufault experiment results {d.id}`",
            "",
        ]
    return out


def render_datas(
    ds: Sequence[ExperimentData],
    title: str | None = None,
    maps: Sequence[ExploreMap] = (),
) -> str:
    title = title or ("gpufault experiment report: " + ", ".join(d.name for d in ds))
    out = [f"# {title}", ""]
    for m in maps:
        out += map_md(m)
    out += ["## Verification matrix", ""]
    out += matrix_md(ds)
    for d in ds:
        out += experiment_md(d)
    return "\n".join(out).rstrip() + "\n"


def render_markdown(db: Any, experiment_ids: Sequence[str], title: str | None = None) -> str:
    return render_datas([load(db, i) for i in experiment_ids], title)
