"""A running experiment's burn-rate SLOs ([[slo]]) into gpufault's /metrics
while it runs, so a Prometheus alert on them fires during the fault, as a
production SLO alert would, not only once the verdict is written.

Every `interval` it evaluates each SLO (pyctl/experiment/burn.py) over the
load's finished requests due from the baseline's start until `settle`
seconds ago: a request due later may still be in flight (a stalled one
is exactly the bad kind), so the last `settle` seconds (the load's
timeout: by then every request has an answer or an error) wait for the
next look. The gauges read the latest window's long and short burn and
whether the pair fires; the per-phase worst values come at the end
(Metrics.set_burn).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from pyctl.experiment import burn


class BurnFeed:
    def __init__(
        self,
        slos: list[burn.BurnSLO],
        load: Any,
        metrics: Any,
        start: Callable[[], float | None],
        phase_of: Callable[[float], str],
        settle: float,
        interval: float = 1.0,
    ) -> None:
        self.slos, self.load, self.metrics = slos, load, metrics
        self.start_at, self.phase_of, self.settle = start, phase_of, settle
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gf-exp-burn", daemon=True)

    def start(self) -> BurnFeed:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.look(time.time())

    def look(self, now: float) -> list[burn.Burn]:
        """Evaluate once with `now` as the clock; the latest burn per pair."""
        t0 = self.start_at()
        end = now - self.settle
        if t0 is None or end <= t0:
            return []
        j = burn.evaluate(self.slos, self.load.samples(t0, end), t0, end, self.phase_of)
        latest: dict[tuple[str, str], burn.Burn] = {}
        for b in j.burns:
            latest[(b.slo_id, b.alert)] = b
        for b in latest.values():
            self.metrics.set_burn_now(b.slo_id, b.alert, b.long_burn, b.short_burn, b.firing)
        return list(latest.values())


__all__ = ["BurnFeed"]
