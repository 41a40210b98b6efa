"""The load's other two panels under the timeline, as inline SVG on the
timeline's time axis (same width, margins and t0, so the windows line
up): throughput (successful answers per second, and output tokens per
second on its own right-hand axis when the load streamed) and TTFT/ITL
(time to first token and inter-token latency, p50 and p99 per window).
The file's bounds are dashed lines, a window that broke one is a red tick
on its panel's top edge with a title that says which and by how much,
the fault steps' windows are shaded, and a burn-rate SLO's firing alert
is a strip under the throughput panel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from html import escape

from pyctl.report.data import ExperimentData
from pyctl.report.svg import C_FAULT, C_NOT_OK, LEFT, RIGHT, W, _ms, _nice_step, _polyline

PANEL_H = 120
TOP = 24  # a panel's title row
C_REQ, C_TOK = "#1f6fb4", "#2b8a3e"
C_TTFT50, C_TTFT99, C_ITL50, C_ITL99 = "#74c0fc", "#1864ab", "#ffa94d", "#d9480f"
BURN_H = 12


def _has(d: ExperimentData, *cols: str) -> bool:
    return any(w.get(c) is not None for w in d.windows for c in cols)


class _Panel:
    """One panel: a linear y axis from 0 over [y0, y0 + PANEL_H]."""

    def __init__(self, y0: float, hi: float) -> None:
        self.y0 = y0
        step = _nice_step(hi if hi > 0 else 1.0, 4)
        self.step = step
        self.hi = max(step * math.ceil((hi if hi > 0 else 1.0) * 1.08 / step), step)

    def y(self, v: float) -> float:
        return self.y0 + PANEL_H - min(v, self.hi) / self.hi * PANEL_H

    def ticks(self) -> list[float]:
        return [i * self.step for i in range(int(round(self.hi / self.step)) + 1)]


def _frame(p: _Panel, title: str, fmt: Callable[[float], str], right: bool = False) -> list[str]:
    out = [
        f'<text x="{LEFT}" y="{p.y0 - 8:.0f}" fill="#343a40" font-weight="600">'
        f"{escape(title)}</text>",
        f'<rect x="{LEFT}" y="{p.y0}" width="{W - LEFT - RIGHT}" height="{PANEL_H}" '
        'fill="none" stroke="#adb5bd"/>',
    ]
    for v in p.ticks():
        yy = p.y(v)
        if not right:
            out.append(
                f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e9ecef"/>'
            )
        # The right-hand axis's labels inside the frame (the margin is 16 px).
        xx, anchor = (W - RIGHT - 4, "end") if right else (LEFT - 6, "end")
        out.append(
            f'<text x="{xx}" y="{yy + 4:.1f}" text-anchor="{anchor}" fill="#495057">'
            f"{escape(fmt(v))}</text>"
        )
    return out


def _bound(
    p: _Panel, key: str, value: float, shown: float, color: str, label: str, x1: float
) -> list[str]:
    yy = p.y(shown)
    if not p.y0 <= yy <= p.y0 + PANEL_H:
        return []
    return [
        f'<line class="slo-bound slo-{key}" x1="{LEFT}" x2="{x1}" y1="{yy:.1f}" y2="{yy:.1f}"'
        f' stroke="{color}" stroke-width="1.2" stroke-dasharray="6 4"><title>SLO: '
        f"{escape(label)} per window</title></line>",
        f'<text x="{x1 - 4}" y="{yy - 4:.1f}" text-anchor="end" fill="{color}">'
        f"{escape(label)}</text>",
    ]


def load_panels(d: ExperimentData) -> str:
    """The throughput and TTFT/ITL panels; "" when the load had neither."""
    wins = d.windows
    if not wins:
        return ""
    t0, span = d.t0, max(d.t1 - d.t0, 1.0)

    def x(t: float) -> float:
        return LEFT + (t - t0) / span * (W - LEFT - RIGHT)

    streamed = _has(d, "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
    tokens = _has(d, "output_tokens_per_s")
    burns = [r for r in d.burn_summary() if r["firing_windows"]]
    bounds = d.token_bounds()
    mid = [((w["start"] + w["end"]) / 2, w) for w in wins]
    y = TOP
    tp = _Panel(y, max([w.get("throughput") or 0 for w in wins] + [1.0]))
    y += PANEL_H + (BURN_H * len(burns) + 8 if burns else 0) + TOP + 16
    lp = None
    if streamed:
        vals: list[float] = [1000 * (w.get(k) or 0) for w in wins for k in ("ttft_p99", "itl_p99")]
        for k in ("ttft_p50", "ttft_p95", "ttft_p99", "itl_p50", "itl_p95", "itl_p99"):
            if k in bounds:
                vals.append(1000 * bounds[k][1])
        lp = _Panel(y, max(vals + [1.0]))
        y += PANEL_H + 16
    height = y + 24
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="load-panels" viewBox="0 0 {W} '
        f'{height:.0f}" width="{W}" height="{height:.0f}" role="img" '
        f'data-experiment="{escape(d.id)}" font-family="system-ui, sans-serif" font-size="11">',
        f"<title>throughput and token latency of experiment {escape(d.name)}</title>",
    ]
    panels = [tp] + ([lp] if lp is not None else [])
    for st in d.steps:
        sw = d.step_window(st)
        if sw is None:
            continue
        xa, xb = x(sw[0]), x(sw[1])
        for p in panels:
            out.append(
                f'<rect class="panel-fault-window" x="{xa:.1f}" y="{p.y0}" '
                f'width="{max(xb - xa, 2):.1f}" height="{PANEL_H}" fill="{C_FAULT}" '
                f'fill-opacity="0.10"><title>step '
                f"{st['idx'] + 1} {escape(str(st.get('name') or ''))}: {sw[0] - t0:.2f}-"
                f"{sw[1] - t0:.2f} s</title></rect>"
            )

    # Throughput: answers/s on the left axis, output tokens/s on the right.
    title = "throughput (answers/s" + (", output tokens/s right)" if tokens else ")")
    out += _frame(tp, title, lambda v: f"{v:g}/s")
    pts = [(x(t), tp.y(w["throughput"])) for t, w in mid if w.get("throughput") is not None]
    out.append(_polyline(pts, C_REQ, 2, ' class="line-throughput"'))
    if "min_throughput" in bounds:
        b = bounds["min_throughput"][1]
        out += _bound(tp, "min_throughput", b, b, C_REQ, f"throughput >= {b:g}/s", W - RIGHT)
    if tokens:
        tk = _Panel(tp.y0, max([w.get("output_tokens_per_s") or 0 for w in wins] + [1.0]))
        out += _frame(tk, "", lambda v: f"{v:g}", right=True)

        def tky(v: float) -> float:
            return tp.y0 + PANEL_H - min(v, tk.hi) / tk.hi * PANEL_H

        pts = [(x(t), tky(w["output_tokens_per_s"])) for t, w in mid
               if w.get("output_tokens_per_s") is not None]  # fmt: skip
        out.append(_polyline(pts, C_TOK, 2, ' class="line-output-tokens"'))
        if "output_tokens_per_s" in bounds:
            b = bounds["output_tokens_per_s"][1]
            out += _bound(tk, "output_tokens_per_s", b, b, C_TOK,
                          f"output tokens >= {b:g}/s", W - RIGHT - 150)  # fmt: skip
    for t, w in mid:
        if w.get("throughput") is not None:
            tok = w.get("output_tokens_per_s")
            out.append(
                f'<circle cx="{x(t):.1f}" cy="{tp.y(w["throughput"]):.1f}" r="2" fill="{C_REQ}">'
                f"<title>{t - t0:.0f} s: {w['throughput']:.1f} answers/s"
                + (f", {tok:.0f} output tokens/s" if tok is not None else "")
                + "</title></circle>"
            )
    # A burn-rate SLO's alert, a strip per pair that fired, red while firing.
    by = {(r["slo_id"], r["alert"]) for r in burns}
    for i, (sid, alert) in enumerate(sorted(by)):
        yy = tp.y0 + PANEL_H + 6 + i * BURN_H
        out.append(
            f'<rect x="{LEFT}" y="{yy}" width="{W - LEFT - RIGHT}" height="{BURN_H - 3}" '
            'fill="#f8f9fa"/>'
        )
        label = (
            f'<text x="{LEFT + 4}" y="{yy + 8}" fill="#495057" font-size="9">'
            f"slo {escape(sid)}: {escape(alert)}</text>"
        )
        for br in d.slo_burns:
            if (br["slo_id"], br["alert"]) != (sid, alert) or not br.get("firing"):
                continue
            xa, xb = x(br["at"] - 1.0), x(br["at"])
            out.append(
                f'<rect class="burn-firing" x="{xa:.1f}" y="{yy}" width="{max(xb - xa, 1):.1f}"'
                f' height="{BURN_H - 3}" fill="{C_NOT_OK}"><title>slo {escape(sid)}: '
                f"{escape(alert)} firing at +{br['at'] - t0:.0f} s (long "
                f"{br.get('long_burn') or 0:.3g}x, short {br.get('short_burn') or 0:.3g}x)"
                "</title></rect>"
            )
        out.append(label)  # over its red marks, so it reads where it fired

    if lp is not None:
        out += _frame(lp, "time to first token and inter-token latency (p50, p99)", _ms)
        for key, color, width in (
            ("ttft_p50", C_TTFT50, 1.5),
            ("ttft_p99", C_TTFT99, 2),
            ("itl_p50", C_ITL50, 1.5),
            ("itl_p99", C_ITL99, 2),
        ):
            pts = [(x(t), lp.y(1000 * w[key])) for t, w in mid if w.get(key) is not None]
            out.append(_polyline(pts, color, width, f' class="line-{key}"'))
        colors = {"ttft": C_TTFT99, "itl": C_ITL99}
        for key, (_op, b) in bounds.items():
            if key.startswith(("ttft", "itl")):
                out += _bound(lp, key, b, 1000 * b, colors[key.split("_")[0]],
                              f"{key} SLO {_ms(1000 * b)}", W - RIGHT)  # fmt: skip
        for t, w in mid:
            if w.get("itl_p99") is not None or w.get("ttft_p99") is not None:
                out.append(
                    f'<circle cx="{x(t):.1f}" cy="{lp.y(1000 * (w.get("itl_p99") or 0)):.1f}" '
                    f'r="2" fill="{C_ITL99}"><title>{t - t0:.0f} s: ttft p50 '
                    f"{1000 * (w.get('ttft_p50') or 0):.1f} ms, p99 "
                    f"{1000 * (w.get('ttft_p99') or 0):.1f} ms; itl p50 "
                    f"{1000 * (w.get('itl_p50') or 0):.1f} ms, p99 "
                    f"{1000 * (w.get('itl_p99') or 0):.1f} ms</title></circle>"
                )
    # Breached windows: a red tick on the top edge of the panel of the term.
    for w in wins:
        why = d.token_breaches(w)
        which: list[tuple[_Panel | None, tuple[str, ...]]] = [
            (tp, ("throughput", "output_tokens")),
            (lp, ("ttft", "itl")),
        ]
        for panel, terms in which:
            mine = [s for s in why if s.startswith(terms)]
            if panel is None or not mine:
                continue
            xa, xb = x(w["start"]), x(w["end"])
            out.append(
                f'<rect class="breach" x="{xa:.1f}" y="{panel.y0}" '
                f'width="{max(xb - xa, 1):.1f}" height="5" fill="{C_NOT_OK}"><title>'
                f"{w['start'] - t0:.0f} s: {escape('; '.join(mine))}</title></rect>"
            )
    out += _legend(streamed, tokens, bool(burns), y + 4)
    out.append("</svg>")
    return "\n".join(o for o in out if o)


def _legend(streamed: bool, tokens: bool, burns: bool, y: float) -> list[str]:
    items: list[tuple[str, str]] = [(C_REQ, "answers/s")]
    if tokens:
        items.append((C_TOK, "output tokens/s"))
    if streamed:
        items += [(C_TTFT50, "TTFT p50"), (C_TTFT99, "TTFT p99"), (C_ITL50, "ITL p50"),
                  (C_ITL99, "ITL p99")]  # fmt: skip
    out = [f'<g class="legend" transform="translate({LEFT} {y + 10:.0f})">']
    xx = 0.0
    for color, label in items:
        out.append(
            f'<g transform="translate({xx} 0)"><line x1="0" x2="16" y1="-4" y2="-4" '
            f'stroke="{color}" stroke-width="2"/><text x="20" y="-1" fill="#343a40">'
            f"{escape(label)}</text></g>"
        )
        xx += 26 + 6.5 * len(label) + 12
    if burns:
        out.append(
            f'<g transform="translate({xx} 0)"><rect x="0" y="-10" width="12" height="9" '
            f'fill="{C_NOT_OK}"/><text x="20" y="-1" fill="#343a40">burn-rate alert firing'
            "</text></g>"
        )
    out.append("</g>")
    return out


__all__ = ["load_panels"]
