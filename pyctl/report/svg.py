"""The timeline plot of one experiment, drawn as inline SVG (no library, no
script): latency p50/p99 (and p95, faint) over time, the error rate below
it on its own axis, the phases as a strip on top, each fault step's window
shaded across both panels, each fault ID a numbered marker, Xids and
anchors as dashed lines with their labels, the recovery as a green line.
Every mark has a <title>, which browsers show on hover.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

from pyctl.report.data import ExperimentData

W = 1080
LEFT, RIGHT = 80, 16
PHASE_Y, PHASE_H = 20, 14
FAULT_Y = 49  # the row of fault markers (labels above)
LAT_Y, LAT_H = 62, 230
EV_Y = LAT_Y + LAT_H + 4  # the row of Xid / anchor labels
ERR_Y, ERR_H = EV_Y + 34, 80
AXIS_Y = ERR_Y + ERR_H
H = AXIS_Y + 40  # without probe rows
PROBE_Y, PROBE_H = AXIS_Y + 44, 14  # one row per probe, below the time axis
MAX_PROBE_ROWS = 8
MAX_FAULT_MARKERS = 200  # more: a strip of ticks
C_OK, C_NOT_OK = "#40c057", "#fa5252"

PHASE_COLORS = {
    "baseline": "#dbe9f6",
    "arming": "#eceff1",
    "fault": "#f8d7d3",
    "recovery": "#fdf0c9",
    "after": "#dff0db",
}
C_P50, C_P95, C_P99 = "#1f6fb4", "#9bbad8", "#d9480f"
C_ERR, C_FAULT, C_XID, C_ANCHOR, C_REC = "#c92a2a", "#e8590c", "#7048e8", "#343a40", "#2b8a3e"


def _nice_step(span: float, target: int) -> float:
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _ms(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:g} s"
    return f"{v:g} ms" if v >= 1 else f"{v:.2g} ms"


class _Y:
    """A latency axis in ms: linear, or log10 when the values span more
    than ~30x (a hang's p99 next to a healthy p50)."""

    def __init__(self, values: list[float]) -> None:
        vals = [v for v in values if v > 0]
        lo = min(vals) if vals else 1.0
        hi = max(vals) if vals else 10.0
        self.log = hi / lo > 30
        if self.log:
            self.lo = 10 ** math.floor(math.log10(lo))
            self.hi = 10 ** math.ceil(math.log10(hi))
            if self.hi <= self.lo:
                self.hi = self.lo * 10
        else:
            step = _nice_step(hi, 5)
            self.lo, self.hi = 0.0, max(step * math.ceil(hi * 1.08 / step), step)
            self.step = step

    def y(self, v: float) -> float:
        if self.log:
            v = max(v, self.lo)
            f = (math.log10(v) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            f = (v - self.lo) / (self.hi - self.lo)
        return LAT_Y + LAT_H - f * LAT_H

    def ticks(self) -> list[float]:
        if self.log:
            # 1-2-5 per decade: three decades read as well as a linear axis.
            out, v = [], self.lo
            while v <= self.hi * 1.0001:
                out += [m * v for m in (1, 2, 5) if m * v <= self.hi * 1.0001]
                v *= 10
            return out
        n = int(round((self.hi - self.lo) / self.step))
        return [self.lo + i * self.step for i in range(n + 1)]


def _polyline(pts: list[tuple[float, float]], color: str, width: float, extra: str = "") -> str:
    if not pts:
        return ""
    d = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
    return (
        f'<polyline fill="none" stroke="{color}" stroke-width="{width}" '
        f'stroke-linejoin="round" points="{d}"{extra}/>'
    )


def timeline(d: ExperimentData) -> str:
    t0, t1 = d.t0, d.t1
    span = max(t1 - t0, 1.0)

    def x(t: float) -> float:
        return LEFT + (t - t0) / span * (W - LEFT - RIGHT)

    probes = list(d.probes.items())[:MAX_PROBE_ROWS]
    height = PROBE_Y + PROBE_H * len(probes) + 4 if probes else H
    # Fault windows shade the probe rows too, so a probe's change lines up.
    bottom = PROBE_Y + PROBE_H * len(probes) - 2 if probes else AXIS_Y
    out: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" viewBox="0 0 {W} {height}" '
        f'width="{W}" height="{height}" role="img" data-experiment="{escape(d.id)}" '
        f'font-family="system-ui, sans-serif" font-size="11">',
        f"<title>timeline of experiment {escape(d.name)}</title>",
    ]
    wins = d.windows
    mid = [((w["start"] + w["end"]) / 2, w) for w in wins]
    lat_vals = [1000 * w[k] for w in wins for k in ("p50", "p99") if w.get(k) is not None]
    ya = _Y(lat_vals)

    # Phase strip, from the load windows' phases (runs of equal phase). The
    # fault phase begins when the first step was armed: the time between the
    # method's start and then is "arming" (0.5-4 s under load, a child
    # controller attaching), not a fault.
    runs: list[tuple[str, float, float]] = []
    for w in wins:
        ph = w.get("phase") or ""
        if runs and runs[-1][0] == ph and abs(runs[-1][2] - w["start"]) < 1.5:
            runs[-1] = (ph, runs[-1][1], w["end"])
        else:
            runs.append((ph, w["start"], w["end"]))
    armed = d.first_armed()
    for i, (ph, a, b) in enumerate(runs):
        if ph == "fault" and armed is not None and a + 0.1 < armed < b:
            runs[i : i + 1] = [("arming", a, armed), (ph, armed, b)]
            break
    for ph, a, b in runs:
        xa, xb = x(a), x(b)
        out.append(
            f'<rect class="phase" x="{xa:.1f}" y="{PHASE_Y}" width="{max(xb - xa, 1):.1f}"'
            f' height="{PHASE_H}" fill="{PHASE_COLORS.get(ph, "#eee")}">'
            f"<title>{escape(ph)} {a - t0:.1f}-{b - t0:.1f} s</title></rect>"
        )
        if xb - xa > 40:
            out.append(
                f'<text x="{(xa + xb) / 2:.1f}" y="{PHASE_Y + 11}" text-anchor="middle"'
                f' fill="#495057">{escape(ph)}</text>'
            )

    # Fault windows, across both panels.
    for st in d.steps:
        sw = d.step_window(st)
        if sw is None:
            continue
        xa, xb = x(sw[0]), x(sw[1])
        planned = st.get("started_at") is None
        out.append(
            f'<rect class="fault-window" x="{xa:.1f}" y="{LAT_Y}" width="{max(xb - xa, 2):.1f}"'
            f' height="{bottom - LAT_Y}" fill="{C_FAULT}" fill-opacity="0.10"'
            f' stroke="{C_FAULT}" stroke-opacity="0.5" stroke-dasharray="4 3">'
            f"<title>step {st['idx'] + 1} {escape(str(st.get('name') or ''))}"
            f"{' (planned)' if planned else ''}: {sw[0] - t0:.2f}-{sw[1] - t0:.2f} s, "
            f"{st.get('fires') if st.get('fires') is not None else '?'} fires</title></rect>"
        )
        out.append(
            f'<text x="{xa + 4:.1f}" y="{LAT_Y + 13}" fill="{C_FAULT}" font-weight="600">'
            f"{st['idx'] + 1} {escape(str(st.get('name') or ''))}</text>"
        )

    # Latency grid and axis.
    for v in ya.ticks():
        yy = ya.y(v)
        out.append(
            f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e9ecef"/>'
        )
        out.append(
            f'<text x="{LEFT - 6}" y="{yy + 4:.1f}" text-anchor="end" fill="#495057">'
            f"{_ms(v)}</text>"
        )
    out.append(
        f'<text x="16" y="{LAT_Y + LAT_H / 2:.0f}" transform="rotate(-90 16 '
        f'{LAT_Y + LAT_H / 2:.0f})" text-anchor="middle" fill="#495057">latency'
        f"{' (log)' if ya.log else ''}</text>"
    )
    out.append(
        f'<rect x="{LEFT}" y="{LAT_Y}" width="{W - LEFT - RIGHT}" height="{LAT_H}" '
        f'fill="none" stroke="#adb5bd"/>'
    )
    for key, color, width, cls in (
        ("p95", C_P95, 1.2, "p95"),
        ("p50", C_P50, 2, "p50"),
        ("p99", C_P99, 2, "p99"),
    ):
        pts = [(x(t), ya.y(1000 * w[key])) for t, w in mid if w.get(key) is not None]
        out.append(_polyline(pts, color, width, f' class="line-{cls}"'))
    # The file's bounds as dashed lines, and each window that broke one as
    # a red tick on the panel's top edge (its title says which and by how much).
    bounds = d.slo_bounds()
    for key, color in (("p50", C_P50), ("p95", C_P95), ("p99", C_P99)):
        if key not in bounds:
            continue
        yy = ya.y(1000 * bounds[key])
        if not LAT_Y <= yy <= LAT_Y + LAT_H:
            continue
        out.append(
            f'<line class="slo-bound slo-{key}" x1="{LEFT}" x2="{W - RIGHT}" y1="{yy:.1f}"'
            f' y2="{yy:.1f}" stroke="{color}" stroke-width="1.2" stroke-dasharray="6 4">'
            f"<title>SLO: {key} &lt;= {_ms(1000 * bounds[key])} per window</title></line>"
        )
        out.append(
            f'<text x="{W - RIGHT - 4}" y="{yy - 4:.1f}" text-anchor="end" fill="{color}">'
            f"{key} SLO {_ms(1000 * bounds[key])}</text>"
        )
    for w in wins:
        why = d.breaches(w)
        if not why:
            continue
        xa, xb = x(w["start"]), x(w["end"])
        out.append(
            f'<rect class="breach" x="{xa:.1f}" y="{LAT_Y}" width="{max(xb - xa, 1):.1f}"'
            f' height="5" fill="{C_NOT_OK}"><title>{w["start"] - t0:.0f} s: '
            f"{escape('; '.join(why))}</title></rect>"
        )
    for t, w in mid:
        if w.get("p99") is not None:
            out.append(
                f'<circle cx="{x(t):.1f}" cy="{ya.y(1000 * w["p99"]):.1f}" r="2.2" '
                f'fill="{C_P99}"><title>{t - t0:.0f} s: p50 {1000 * (w.get("p50") or 0):.1f}'
                f" ms, p99 {1000 * w['p99']:.1f} ms, {w.get('count')} requests, "
                f"errors {100 * (w.get('error_rate') or 0):.1f} %</title></circle>"
            )

    # Error rate panel.
    emax = max([w.get("error_rate") or 0 for w in wins] + [0.05])
    estep = _nice_step(emax, 2)
    etop = estep * math.ceil(emax / estep)

    def ey(v: float) -> float:
        return ERR_Y + ERR_H - v / etop * ERR_H

    for i in range(int(round(etop / estep)) + 1):
        v = i * estep
        out.append(
            f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{ey(v):.1f}" y2="{ey(v):.1f}" '
            f'stroke="#e9ecef"/>'
        )
        out.append(
            f'<text x="{LEFT - 6}" y="{ey(v) + 4:.1f}" text-anchor="end" '
            f'fill="#495057">{100 * v:g} %</text>'
        )
    out.append(
        f'<text x="16" y="{ERR_Y + ERR_H / 2:.0f}" transform="rotate(-90 16 '
        f'{ERR_Y + ERR_H / 2:.0f})" text-anchor="middle" fill="#495057">errors</text>'
    )
    if "error_rate" in bounds and bounds["error_rate"] <= etop:
        yy = ey(bounds["error_rate"])
        out.append(
            f'<line class="slo-bound slo-error_rate" x1="{LEFT}" x2="{W - RIGHT}" y1="{yy:.1f}"'
            f' y2="{yy:.1f}" stroke="{C_ERR}" stroke-width="1.2" stroke-dasharray="6 4">'
            f"<title>SLO: errors &lt;= {100 * bounds['error_rate']:g} % per window</title></line>"
        )
    for w in wins:
        er = w.get("error_rate") or 0
        if er <= 0:
            continue
        xa, xb = x(w["start"]), x(w["end"])
        out.append(
            f'<rect class="err" x="{xa + 0.5:.1f}" y="{ey(er):.1f}" '
            f'width="{max(xb - xa - 1, 1):.1f}" height="{ERR_Y + ERR_H - ey(er):.1f}" '
            f'fill="{C_ERR}" fill-opacity="0.75"><title>{w["start"] - t0:.0f} s: '
            f"{100 * er:.1f} % errors</title></rect>"
        )
    out.append(
        f'<rect x="{LEFT}" y="{ERR_Y}" width="{W - LEFT - RIGHT}" height="{ERR_H}" '
        f'fill="none" stroke="#adb5bd"/>'
    )

    # Time axis (seconds from the start).
    step = _nice_step(span, 10)
    k = 0
    while k * step <= span + 1e-9:
        xx = x(t0 + k * step)
        out.append(
            f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{AXIS_Y}" y2="{AXIS_Y + 4}" stroke="#495057"/>'
        )
        out.append(
            f'<text x="{xx:.1f}" y="{AXIS_Y + 16}" text-anchor="middle" fill="#495057">'
            f"{k * step:g} s</text>"
        )
        k += 1
    out.append(
        f'<text x="{W - RIGHT}" y="{AXIS_Y + 32}" text-anchor="end" fill="#868e96">'
        "time since the experiment started</text>"
    )

    out += _probe_rows(d, probes, x)
    out += _markers(d, x)
    out += _recovery(d, x)
    out += _legend(d)
    out.append("</svg>")
    return "\n".join(o for o in out if o)


def _markers(d: ExperimentData, x: Any) -> list[str]:
    out: list[str] = []
    faults = [m for m in d.markers if m.kind == "fault"]
    label_faults = len(faults) <= 24
    last_label_x = -1e9
    if len(faults) > MAX_FAULT_MARKERS:
        # A 20 % stall over minutes fires thousands of times: one thin tick
        # each (a density strip), no guide lines; the chains list them.
        ticks = "".join(f"M{x(m.at):.1f},{FAULT_Y}v9" for m in faults)
        return [
            f'<path class="fault-ticks" d="{ticks}" stroke="{C_FAULT}" stroke-width="1"'
            f' stroke-opacity="0.6"><title>{len(faults)} faults</title></path>',
            *_xid_anchor(d, x),
        ]
    for m in faults:
        xx = x(m.at)
        out.append(
            f'<g class="fault-marker" data-fault-id="{escape(m.fault_id or "")}">'
            f'<path d="M{xx - 5:.1f},{FAULT_Y} L{xx + 5:.1f},{FAULT_Y} L{xx:.1f},'
            f'{FAULT_Y + 9} Z" fill="{C_FAULT}"/>'
            f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{FAULT_Y + 9}" y2="{LAT_Y + LAT_H}" '
            f'stroke="{C_FAULT}" stroke-opacity="0.35"/>'
            f"<title>{escape(m.title)} at +{m.at - d.t0:.2f} s</title>"
        )
        if label_faults and xx - last_label_x > 22:
            out.append(
                f'<text x="{xx:.1f}" y="{FAULT_Y - 3}" text-anchor="middle" '
                f'fill="{C_FAULT}" font-size="10">{escape(m.label)}</text>'
            )
            last_label_x = xx
        out.append("</g>")
    return out + _xid_anchor(d, x)


def _xid_anchor(d: ExperimentData, x: Any) -> list[str]:
    # Xids and anchors: dashed lines through both panels, labels in the row
    # between them, alternating two lines so neighbours do not overprint.
    out: list[str] = []
    row = 0
    last_x = -1e9
    for m in (m for m in d.markers if m.kind in ("xid", "anchor")):
        xx = x(m.at)
        color = C_XID if m.kind == "xid" else C_ANCHOR
        row = (row + 1) % 2 if xx - last_x < 110 else 0
        last_x = xx
        ly = EV_Y + 12 + 13 * row
        shape = (
            f'<path d="M{xx:.1f},{ly - 9} l4,4 l-4,4 l-4,-4 Z" fill="{color}"/>'
            if m.kind == "xid"
            else f'<rect x="{xx - 3.5:.1f}" y="{ly - 8.5}" width="7" height="7" fill="{color}"/>'
        )
        out.append(
            f'<g class="{m.kind}-marker"><line x1="{xx:.1f}" x2="{xx:.1f}" y1="{LAT_Y}" '
            f'y2="{AXIS_Y}" stroke="{color}" stroke-dasharray="3 3"/>{shape}'
            f'<text x="{xx + 7:.1f}" y="{ly}" fill="{color}">{escape(m.label)}</text>'
            f"<title>{escape(m.title)} at +{m.at - d.t0:.2f} s</title></g>"
        )
    return out


def _probe_rows(
    d: ExperimentData, probes: list[tuple[str, list[tuple[float, bool | None]]]], x: Any
) -> list[str]:
    """Each probe's samples as a row of ticks, green ok, red not ok: the
    degradation path (breaker-open, degraded) and health going red and back."""
    out: list[str] = []
    for i, (name, samples) in enumerate(probes):
        y = PROBE_Y + i * PROBE_H
        out.append(
            f'<text x="{LEFT - 6}" y="{y + 10}" text-anchor="end" fill="#495057" '
            f'font-size="10">{escape(name[:18])}</text>'
            f'<rect x="{LEFT}" y="{y + 1}" width="{W - LEFT - RIGHT}" height="{PROBE_H - 3}" '
            'fill="#f8f9fa"/>'
        )
        ok_d: list[str] = []
        bad_d: list[str] = []
        for at, ok in samples:
            if ok is not None:
                (ok_d if ok else bad_d).append(f"M{x(at):.1f},{y + 2}v{PROBE_H - 5}")
        n_ok, n = len(ok_d), len(ok_d) + len(bad_d)
        for dd, color in (("".join(ok_d), C_OK), ("".join(bad_d), C_NOT_OK)):
            if dd:
                out.append(
                    f'<path class="probe-samples" d="{dd}" stroke="{color}" stroke-width="2">'
                    f"<title>probe {escape(name)}: ok in {n_ok} of {n} samples</title></path>"
                )
    return out


def _recovery(d: ExperimentData, x: Any) -> list[str]:
    end, rec = d.faults_ended, d.recovery_s()
    if end is None or rec is None:
        return []
    xx = x(end + rec)
    return [
        f'<g class="recovery"><line x1="{xx:.1f}" x2="{xx:.1f}" y1="{LAT_Y}" '
        f'y2="{AXIS_Y}" stroke="{C_REC}" stroke-width="2"/>'
        f'<text x="{xx + 4:.1f}" y="{LAT_Y + 26}" fill="{C_REC}" font-weight="600">'
        f"recovered +{rec:.1f} s</text><title>SLO held again {rec:.2f} s after the "
        f"faults ended</title></g>"
    ]


def _legend(d: ExperimentData) -> list[str]:
    items: list[tuple[str, str]] = [
        (f'<line x1="0" x2="16" y1="-4" y2="-4" stroke="{C_P50}" stroke-width="2"/>', "p50"),
        (f'<line x1="0" x2="16" y1="-4" y2="-4" stroke="{C_P95}" stroke-width="1.2"/>', "p95"),
        (f'<line x1="0" x2="16" y1="-4" y2="-4" stroke="{C_P99}" stroke-width="2"/>', "p99"),
        (
            f'<rect x="0" y="-10" width="12" height="10" fill="{C_ERR}" fill-opacity="0.75"/>',
            "error rate",
        ),
        (
            f'<rect x="0" y="-10" width="14" height="10" fill="{C_FAULT}" fill-opacity="0.15" '
            f'stroke="{C_FAULT}" stroke-dasharray="3 2"/>',
            "fault window",
        ),
        (f'<path d="M0,-10 L10,-10 L5,-1 Z" fill="{C_FAULT}"/>', "fault #seq"),
    ]
    # The rarer marks only where the plot has them.
    kinds = {m.kind for m in d.markers}
    if not d.steps:
        items = [it for it in items if it[1] not in ("fault window", "fault #seq")]
    elif "fault" not in kinds:
        items = [it for it in items if it[1] != "fault #seq"]
    if "xid" in kinds:
        items.append((f'<path d="M5,-10 l4,4 l-4,4 l-4,-4 Z" fill="{C_XID}"/>', "Xid"))
    if "anchor" in kinds:
        items.append((f'<rect x="1" y="-9" width="7" height="7" fill="{C_ANCHOR}"/>', "anchor"))
    if d.probes:
        items.append(
            (
                f'<path d="M2,-10v9M7,-10v9" stroke="{C_OK}" stroke-width="2"/>'
                f'<path d="M12,-10v9" stroke="{C_NOT_OK}" stroke-width="2"/>',
                "probe ok / not",
            )
        )
    if d.faults_ended is not None and d.recovery_s() is not None:
        items.append(
            (
                f'<line x1="0" x2="0" y1="-11" y2="0" stroke="{C_REC}" stroke-width="2"/>',
                "recovered",
            )
        )
    out = ['<g class="legend" transform="translate(80 12)">']
    xx = 0.0
    for shape, label in items:
        out.append(
            f'<g transform="translate({xx} 0)">{shape}<text x="20" y="-1" '
            f'fill="#343a40">{escape(label)}</text></g>'
        )
        xx += 26 + 6.5 * len(label) + 12
    out.append("</g>")
    return out
