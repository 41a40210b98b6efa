"""Multi-window burn-rate SLOs ([[slo]]), as the Google SRE workbook's
"Alerting on SLOs" chapter defines them, on an experiment's time scale.

An SLO says which share of requests must be good (`objective`, e.g. 99 %):
good = no error and every bound of `good` met (ttft, itl, tpot, e2e; the
goodput's GoodBounds). The error budget is 1 - objective; the burn rate
over a window is the window's bad share / the budget (1 = the budget is
spent exactly at the SLO's period, 14.4 = 2 % of a 30-day budget in an
hour). An alert is a pair: it fires at a moment when both the long and
the short window ending there burn above `factor` (the long window makes
it significant, the short one makes it stop soon after the burn stops).

The workbook's pairs are hours (1 h + 5 min at 14.4, 6 h + 30 min at 6);
an experiment lasts seconds, so the default pairs keep the workbook's
ratios with 1 h = 12 s (12 s + 1 s at 14.4, 72 s + 6 s at 6). The
resolution is the load's 1 s window (model.WINDOW_S).

Nothing here runs: parse_slos() reads the file's tables, count() and
burns() are pure functions over load samples, evaluate.py calls them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyctl.experiment.model import WINDOW_S, GoodBounds
from pyctl.experiment.reader import Reader, kind_name, parse_bound

SLO_KEYS = {"id", "objective", "good", "windows", "description"}
GOOD_KEYS = {"ttft", "itl", "tpot", "e2e"}
ALERT_KEYS = {"long", "short", "factor"}
# The workbook's two page-worthy pairs, 1 h of theirs = 12 s here.
DEFAULT_ALERTS = (("12s", "1s", 14.4), ("72s", "6s", 6.0))
_ID = re.compile(r"[a-z0-9][a-z0-9._-]*")


@dataclass(frozen=True)
class Alert:
    """One long + short window pair and the burn rate both must exceed."""

    long: float  # seconds
    short: float
    factor: float

    @property
    def name(self) -> str:
        return f"{self.factor:g}x {self.long:g}s/{self.short:g}s"


@dataclass(frozen=True)
class BurnSLO:
    id: str
    objective: float  # 0 < objective < 1
    good: GoodBounds  # no bound at all: only errors are bad
    alerts: tuple[Alert, ...]
    description: str = ""

    @property
    def budget(self) -> float:
        return 1.0 - self.objective

    def is_good(self, s: Any) -> bool:
        """One loadgen.Sample: no error and every bound met."""
        return not s.error and self.good(s)

    def streamed(self) -> bool:
        return bool(self.good.ttft or self.good.itl or self.good.tpot)

    def __str__(self) -> str:
        good = ", ".join(x for x in (str(self.good), "no error") if x)
        return f"objective {self.objective * 100:.4g}% good: {good}"


@dataclass(frozen=True)
class Counted:
    """One 1 s window of one SLO: requests due in [start, end), the good ones."""

    slo_id: str
    start: float
    end: float
    total: int
    good: int
    phase: str = ""


@dataclass(frozen=True)
class Burn:
    """One alert pair evaluated at the end of a window (`at`)."""

    slo_id: str
    alert: str
    long_s: float
    short_s: float
    factor: float
    at: float
    phase: str
    long_burn: float
    short_burn: float

    @property
    def firing(self) -> bool:
        return self.long_burn > self.factor and self.short_burn > self.factor


# ---- the file's [[slo]] tables ---------------------------------------------------------


def _objective(r: Reader, key: str, v: Any) -> float:
    text = v
    if isinstance(v, str) and v.strip().endswith("%"):
        try:
            v = float(v.strip()[:-1]) / 100
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
        raise r.err(key, f'{text!r}: give the share of good requests, e.g. "99.9%" or 0.999')
    return float(v)


def _alerts(r: Reader, key: str, v: Any, budget: float) -> tuple[Alert, ...]:
    given = v
    if v is None:
        v = [{"long": lo, "short": sh, "factor": f} for lo, sh, f in DEFAULT_ALERTS]
    if not isinstance(v, list) or not v:
        raise r.err(key, 'expected a list such as [{ long = "12s", short = "1s", factor = 14.4 }]')
    out = []
    for i, t in enumerate(v):
        k = f"{key}[{i}]"
        if not isinstance(t, dict):
            raise r.err(k, f"expected a table {{long, short, factor}}, got {kind_name(t)}")
        r.keys(t, k, ALERT_KEYS)
        long_ = r.duration(t, k, "long")
        short = r.duration(t, k, "short")
        factor = r.num(t, k, "factor", what="a burn rate such as 14.4")
        if short < WINDOW_S or abs(short / WINDOW_S - round(short / WINDOW_S)) > 1e-9:
            raise r.err(
                f"{k}.short", f"{short:g}s: give whole seconds (the load's windows are 1 s)"
            )
        if long_ <= short or abs(long_ / WINDOW_S - round(long_ / WINDOW_S)) > 1e-9:
            raise r.err(f"{k}.long", f"{long_:g}s: give whole seconds, longer than short")
        if not factor > 0:
            raise r.err(f"{k}.factor", f"{factor:g}: give a burn rate above 0")
        if factor * budget >= 1 and given is None:
            raise r.err(
                key.rsplit(".", 1)[0] + ".objective",
                f"with a {budget:.4g} error budget the burn rate is at most {1 / budget:.4g}, "
                f"so the default pair {factor:g}x over {long_:g}s/{short:g}s can never fire: "
                "raise the objective or give windows",
            )
        if factor * budget >= 1:
            raise r.err(
                f"{k}.factor",
                f"{factor:g} can never fire: with a {budget:.4g} error budget the burn rate "
                f"is at most {1 / budget:.4g}; lower it or raise the objective",
            )
        out.append(Alert(long_, short, factor))
    return tuple(out)


def parse_slos(r: Reader, doc: dict[str, Any]) -> list[BurnSLO]:
    """[[slo]] tables; one ExperimentError line for anything wrong."""
    v = doc.get("slo")
    if v is None:
        return []
    if isinstance(v, dict):
        v = [v]
    if not isinstance(v, list):
        raise r.err("slo", "expected [[slo]] tables (id, objective, good, windows)")
    out: list[BurnSLO] = []
    for i, t in enumerate(v):
        key = f"slo[{i}]"
        if not isinstance(t, dict):
            raise r.err(key, f"expected a table, got {kind_name(t)}")
        r.keys(t, key, SLO_KEYS)
        sid = r.str_(t, key, "id")
        if not _ID.fullmatch(sid):
            raise r.err(f"{key}.id", f"{sid!r}: use lower-case letters, digits, '.', '_' and '-'")
        if any(s.id == sid for s in out):
            raise r.err(f"{key}.id", f"{sid!r} is given twice: each SLO needs its own id")
        if "objective" not in t:
            raise r.err(f"{key}.objective", 'missing: give the share of good requests, e.g. "99%"')
        objective = _objective(r, f"{key}.objective", t["objective"])
        g = t.get("good", {})
        if not isinstance(g, dict):
            raise r.err(f"{key}.good", 'expected a table such as { e2e = "<= 300ms" }')
        r.keys(g, f"{key}.good", GOOD_KEYS)
        good = GoodBounds(
            **{
                n: parse_bound(g[n], r, f"{key}.good.{n}", "duration") if n in g else None
                for n in sorted(GOOD_KEYS)
            }
        )
        alerts = _alerts(r, f"{key}.windows", t.get("windows"), 1 - objective)
        desc = r.str_(t, key, "description", "")
        out.append(BurnSLO(sid, objective, good, alerts, desc))
    return out


# ---- counting and burning ---------------------------------------------------------------


def count(slo: BurnSLO, samples: Sequence[Any], start: float, end: float) -> list[Counted]:
    """The SLO's 1 s windows from start: the last one is kept only when it
    is at least half a window (as the load windows are)."""
    srt = sorted(samples, key=lambda s: s.due)
    out = []
    k = 0
    j = 0
    while True:
        a = start + k * WINDOW_S
        b = min(start + (k + 1) * WINDOW_S, end)
        if a >= end - 1e-9 or b - a < WINDOW_S / 2:
            break
        while j < len(srt) and srt[j].due < a:
            j += 1
        total = good = 0
        while j < len(srt) and srt[j].due < b:
            total += 1
            good += slo.is_good(srt[j])
            j += 1
        out.append(Counted(slo.id, a, b, total, good))
        k += 1
    return out


def _rate(wins: Sequence[Counted], budget: float) -> float:
    total = sum(w.total for w in wins)
    if total == 0:
        return 0.0  # nothing due: nothing burnt (an empty window is the load's own finding)
    return (total - sum(w.good for w in wins)) / total / budget


def burns(slo: BurnSLO, wins: Sequence[Counted]) -> list[Burn]:
    """Every alert pair at the end of every window. A window longer than
    the run so far covers what there is (the workbook's alert on a fresh
    SLO does the same: it sees only the data since it started)."""
    out = []
    for i, w in enumerate(wins):
        for al in slo.alerts:
            nl = max(1, int(round(al.long / WINDOW_S)))
            ns = max(1, int(round(al.short / WINDOW_S)))
            out.append(
                Burn(
                    slo.id,
                    al.name,
                    al.long,
                    al.short,
                    al.factor,
                    w.end,
                    w.phase,
                    _rate(wins[max(0, i + 1 - nl) : i + 1], slo.budget),
                    _rate(wins[max(0, i + 1 - ns) : i + 1], slo.budget),
                )
            )
    return out


def budget_spent(slo: BurnSLO, wins: Sequence[Counted]) -> float:
    """The share of the error budget the windows' bad requests used, as if
    the windows were the SLO's whole period (bad share / budget)."""
    return _rate(wins, slo.budget)


def fmt_burn(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}x"


# The hypothesis phases, by the windows' phases (probe_samples' words).
HYP_PHASE = {"baseline": "before", "fault": "during", "recovery": "after", "after": "after"}


@dataclass
class Judged:
    """What evaluate() makes of one run's SLOs: the rows and the verdict's lines."""

    windows: list[Counted]
    burns: list[Burn]
    # (phase, slo_id, ok, value, tolerance, detail, burn): hypothesis_results
    # rows, burn the number behind value (the --json `slo` list's)
    hypotheses: list[tuple[str, str, bool, str, str, str, float]]
    errors: list[str]  # fired in the baseline: nothing can be judged
    failures: list[str]  # fired in the fault window or the recovery
    # (slo_id, alert, phase, worst long burn, worst short burn, fired): metrics
    peaks: list[tuple[str, str, str, float, float, bool]]


def evaluate(
    slos: Sequence[BurnSLO],
    samples: Sequence[Any],
    start: float,
    end: float,
    phase_of: Any,
) -> Judged:
    """Every SLO over [start, end) (the baseline's start to the run's end):
    its windows, each alert pair at each window's end, a hypothesis row
    per phase (ok: no pair fired in it) and the verdict's lines. phase_of
    maps a time to its phase (baseline, fault, recovery, after)."""
    out = Judged([], [], [], [], [], [])
    for slo in slos:
        wins = [
            Counted(w.slo_id, w.start, w.end, w.total, w.good, phase_of((w.start + w.end) / 2))
            for w in count(slo, samples, start, end)
        ]
        bs = burns(slo, wins)
        out.windows += wins
        out.burns += bs
        failed = False  # one failure line per SLO: its first alert after the baseline
        tol = "; ".join(f"burn <= {a.factor:g}x over {a.long:g}s or {a.short:g}s"
                        for a in slo.alerts)  # fmt: skip
        for hyp in ("before", "during", "after"):
            ws = [w for w in wins if HYP_PHASE.get(w.phase) == hyp]
            if not ws:
                continue
            ph = {w.phase for w in ws}
            pb = [b for b in bs if b.phase in ph]
            fired = [b for b in pb if b.firing]
            # The pair closest to firing: its smaller burn over its factor.
            worst = max(pb, key=lambda b: min(b.long_burn, b.short_burn) / b.factor)
            total, good = sum(w.total for w in ws), sum(w.good for w in ws)
            spent = budget_spent(slo, ws)
            first = fired[0] if fired else None
            detail = (
                f"{first.alert} fired at +{first.at - start:.1f}s (long {fmt_burn(first.long_burn)}"
                f", short {fmt_burn(first.short_burn)}); "
                if first
                else ""
            ) + (f"{good}/{total} requests good ({slo}); burn over the phase {fmt_burn(spent)}")
            near = min(worst.long_burn, worst.short_burn)
            out.hypotheses.append((hyp, slo.id, not fired, fmt_burn(near), tol, detail, near))
            if first is not None and not (hyp == "after" and failed):
                failed = hyp != "before"
                line = (
                    f"slo {slo.id}: burn-rate alert {first.alert} fired "
                    f"{'in the baseline' if hyp == 'before' else 'at'} +{first.at - start:.1f}s "
                    f"(long {fmt_burn(first.long_burn)}, short {fmt_burn(first.short_burn)} > "
                    f"{first.factor:g}x; {total - good}/{total} requests bad in the phase)"
                )
                if hyp == "before":  # worded as the other steady-state errors are
                    line = f"steady state not met before the method: {line}"
                (out.errors if hyp == "before" else out.failures).append(line)
        for al in slo.alerts:
            for phase in dict.fromkeys(w.phase for w in wins):
                pb = [b for b in bs if b.alert == al.name and b.phase == phase]
                if pb:
                    out.peaks.append((
                        slo.id, al.name, phase, max(b.long_burn for b in pb),
                        max(b.short_burn for b in pb), any(b.firing for b in pb),
                    ))  # fmt: skip
    return out


__all__ = [
    "DEFAULT_ALERTS",
    "Alert",
    "Burn",
    "BurnSLO",
    "Counted",
    "Judged",
    "burns",
    "evaluate",
    "budget_spent",
    "count",
    "fmt_burn",
    "parse_slos",
]
