"""Outcome of one trial, from its experiment's verdict and evidence rows.

In order, the first that holds:
  not reached       the step never fired (no call came from the site): proves nothing
  error             the experiment ended in error otherwise
  crashed           the target died
  hung              a 1 s window of the fault phase completed no request, or
                    its median request waited out the load's timeout
  SLO broken        a load objective of the hypothesis (p99, error rate, ...)
                    failed during the fault
  did not recover   it failed after, or recovered_within was not met
  degraded within SLO   the load's objectives held, but another steady-state
                    probe failed during the fault (a /health that says
                    "degraded"), errors were answered during
                    the fault or the judge found the window worse than baseline
  tolerated         nothing measurable changed
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pyctl.api.values import parse_duration

OUTCOMES = (
    "tolerated",
    "degraded within SLO",
    "SLO broken",
    "crashed",
    "hung",
    "did not recover",
    "not reached",
    "error",
)


@dataclass(frozen=True)
class Judged:
    outcome: str
    reason: str
    recover_s: float | None
    fires: int


def _load_timeout(rows: list[tuple[Any, ...]]) -> float | None:
    """The experiment's [load] timeout, s (its settings' expanded file)."""
    try:
        t = json.loads(rows[0][0])["file"]["load"]["timeout"]
        return parse_duration(str(t), "timeout")
    except (IndexError, KeyError, TypeError, ValueError):
        return None


def classify(verdict: str, reason: str, conn: Any, exp_id: str) -> Judged:
    def q(sql: str) -> list[tuple[Any, ...]]:
        return list(conn.execute(sql, (exp_id,)).fetchall())

    fires = sum(
        int(r[0] or 0) for r in q("SELECT fires FROM experiment_steps WHERE experiment_id=?")
    )
    rec = q("SELECT ok, value FROM expectations WHERE experiment_id=? AND name='recovered_within'")
    recover_s = float(rec[0][1]) if rec and rec[0][1] is not None else None
    if "never fired" in reason or (verdict == "error" and fires == 0):
        return Judged("not reached", reason, None, fires)
    if "died" in reason:
        return Judged("crashed", reason, None, fires)
    if verdict not in ("pass", "fail"):
        return Judged("error", reason, recover_s, fires)
    fault_windows = q("SELECT count, p50 FROM load_windows WHERE experiment_id=? AND phase='fault'")
    if any(int(c or 0) == 0 for c, _ in fault_windows):
        return Judged(
            "hung", "a 1 s window of the fault phase completed no request", recover_s, fires
        )
    timeout = _load_timeout(q("SELECT settings FROM experiments WHERE id=?"))
    if timeout and any((p50 or 0) >= 0.9 * timeout for _, p50 in fault_windows):
        return Judged(
            "hung",
            f"half the requests of a fault window waited out the load's {timeout:g}s "
            f"timeout; {reason}",
            recover_s,
            fires,
        )
    during = q(
        "SELECT probe, ok, detail FROM hypothesis_results WHERE experiment_id=? AND phase='during'"
    )
    after = q("SELECT ok FROM hypothesis_results WHERE experiment_id=? AND phase='after'")
    # The SLO is the load's objectives (load.p99, load.error_rate, ...); a
    # steady-state probe of another kind (a /health that says "degraded")
    # failing alone is the service degrading within it.
    if any(not ok for probe, ok, _ in during if str(probe).startswith("load.")):
        return Judged("SLO broken", reason, recover_s, fires)
    probes_bad = [(probe, detail) for probe, ok, detail in during if not ok]
    if any(not ok for (ok,) in after) or (rec and not rec[0][0]):
        return Judged("did not recover", reason, recover_s, fires)
    if probes_bad:
        probe, detail = probes_bad[0]
        return Judged(
            "degraded within SLO",
            f"the load's objectives held; probe {probe} did not: {str(detail)[:160]}",
            recover_s,
            fires,
        )
    errs = q("SELECT max(error_rate) FROM load_windows WHERE experiment_id=? AND phase='fault'")
    worse = q("SELECT metric, reason FROM judgements WHERE experiment_id=? AND worse=1")
    if worse:
        return Judged("degraded within SLO", f"judged worse: {worse[0][1]}", recover_s, fires)
    if errs and errs[0][0]:
        return Judged(
            "degraded within SLO",
            f"error rate up to {float(errs[0][0]):.1%} in a fault window, within the SLO",
            recover_s,
            fires,
        )
    if verdict == "fail":
        return Judged("SLO broken", reason, recover_s, fires)
    return Judged("tolerated", "steady state held, nothing measurable changed", recover_s, fires)
