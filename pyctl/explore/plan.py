"""Plan: which (point, fault) trials to run, in which order, within a budget.

Points are ordered by how often requests pass through them (sampled calls,
most first), then each point's faults by class (errors, stalls, a hang);
points that share a caller site and function are one trial (the BPF caller
filter is one return address: it cannot tell their deeper stacks apart).
The plan is data: `explore plan` prints it, a pin file (TOML) narrows it:

    pin = ["3f2a9c01d4"]            # only these points (ids or prefixes)
    exclude = ["9c0e*"]             # never these (globs over ids and functions)
    codes = ["CUDA_ERROR_OUT_OF_MEMORY", "stall:100ms"]   # only these faults
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyctl.api.errors import BadInput
from pyctl.explore import codes as C
from pyctl.explore.discover import Point, read_doc
from pyctl.report.exploremap import short_function


@dataclass(frozen=True)
class Trial:
    idx: int
    point: str  # the first point of the site
    covers: tuple[str, ...]  # every point the trial's filter covers
    library: str
    function: str
    site: str
    action: str  # fail or stall
    code: str  # a code name or number; a stall's time; "hang"

    @property
    def label(self) -> str:
        return C.Code(self.action, self.code).label

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["covers"] = list(self.covers)
        return d


@dataclass(frozen=True)
class Filters:
    pin: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    codes: tuple[str, ...] = ()


def read_filters(path: str | os.PathLike[str] | None) -> Filters:
    if path is None:
        return Filters()
    doc = read_doc(path)
    extra = set(doc) - {"pin", "exclude", "codes"}
    if extra:
        raise BadInput(f"{path}: unknown key {sorted(extra)[0]!r}: use pin, exclude or codes")
    out = {}
    for k in ("pin", "exclude", "codes"):
        v = doc.get(k, [])
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise BadInput(f"{path}: {k}: expected a list of strings")
        out[k] = tuple(v)
    return Filters(**out)


def _hit(p: Point, pats: tuple[str, ...]) -> bool:
    return any(
        p.point.startswith(x)
        or fnmatch.fnmatchcase(p.point, x)
        or fnmatch.fnmatchcase(p.function, x)
        for x in pats
    )


def make_plan(
    points: list[Point],
    filters: Filters = Filters(),
    max_runs: int | None = None,
    budget_s: float | None = None,
    per_trial_s: float = 10.0,
) -> tuple[list[Trial], list[str]]:
    """The trials, in order, and a note per thing left out (budget, pins)."""
    notes: list[str] = []
    chosen = [p for p in points if p.site != "?"]
    if len(chosen) < len(points):
        notes.append(f"{len(points) - len(chosen)} point(s) without a caller site: not injectable")
    if filters.pin:
        chosen = [p for p in chosen if _hit(p, filters.pin)]
    if filters.exclude:
        chosen = [p for p in chosen if not _hit(p, filters.exclude)]
    by_site: dict[tuple[str, str, str], list[Point]] = {}
    for p in sorted(chosen, key=lambda p: -p.calls):
        by_site.setdefault((p.library, p.function, p.site), []).append(p)
    pairs: list[tuple[int, int, list[Point], C.Code]] = []
    for rank, ps in enumerate(by_site.values()):
        for c in (C.parse(x) for x in ps[0].codes):
            if filters.codes and C.spelled(c) not in filters.codes and c.code not in filters.codes:
                continue
            pairs.append((c.klass, rank, ps, c))
    # Every point's errors first (most called first), then stalls, then hangs.
    pairs.sort(key=lambda t: (t[0], t[1]))
    trials = [
        Trial(
            i,
            ps[0].point,
            tuple(p.point for p in ps),
            ps[0].library,
            ps[0].function,
            ps[0].site,
            c.action,
            c.code,
        )
        for i, (_k, _r, ps, c) in enumerate(pairs)
    ]
    limit = len(trials)
    if max_runs is not None:
        limit = min(limit, max_runs)
    if budget_s is not None:
        limit = min(limit, max(0, int(budget_s // per_trial_s)))
    if limit < len(trials):
        notes.append(
            f"budget: {limit} of {len(trials)} trial(s) "
            f"(~{per_trial_s:.0f}s each; raise --max-runs/--budget for more)"
        )
        trials = trials[:limit]
    return trials, notes


def render(trials: list[Trial], points: dict[str, Point], notes: list[str]) -> str:
    lines = [f"{'#':>3}  {'point':10}  {'calls':>6}  {'fault':28}  function @ site"]
    for t in trials:
        p = points.get(t.point)
        site = Path(t.site.split("+")[0]).name + "+" + t.site.rsplit("+", 1)[-1]
        lines.append(
            f"{t.idx:>3}  {t.point:10}  {p.calls if p else 0:>6}  "
            f"{t.label[:28]:28}  {short_function(t.function)} @ {site}"
        )
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
