"""Fires and probe totals of an experiment's steps into gpufault's /metrics.

An experiment's faults are carried out by child controllers (one per step,
pyctl/experiment/steps/fault.py), each writing its fault rows and, at its end, its
run's stats into the experiment's database. `gpufault experiment run
--metrics-addr` serves the parent's Metrics, so the parent reads those rows
back: every `interval` the fault rows each step added since the last look
(gpufault_faults_fired_total by function and code, labelled with the
experiment and its slo_id), and at a step's end its probe hits and lost
events (the run's stats: calls, events_lost + fires_lost). A perturb step
writes its fault row itself, into the same database: the same query finds it.

Reads only, with its own short-lived connection (the children write the
file in WAL mode); a locked or missing table is skipped until the next look.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable, Iterable
from typing import Any


class MetricsFeed:
    def __init__(
        self, db_path: str, metrics: Any, runs: Callable[[], Iterable[str]], interval: float = 0.5
    ) -> None:
        self.db_path, self.metrics, self.runs, self.interval = db_path, metrics, runs, interval
        self._seen: dict[str, int] = {}  # run_id -> the last fault seq counted
        self._totals: dict[str, tuple[float, float]] = {}  # ended run_id -> (calls, lost)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread and the final look never interleave
        self._thread = threading.Thread(target=self._loop, name="gf-exp-metrics", daemon=True)

    def start(self) -> MetricsFeed:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.look()

    def stop(self) -> None:
        """Stop the thread and take a last look: every fire is counted once."""
        self._stop.set()
        self._thread.join(5)
        self.look()

    def look(self) -> None:
        with self._lock:
            try:
                c = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=2)
            except sqlite3.Error:
                return
            try:
                for run_id in list(self.runs()):
                    self._fires(c, run_id)
                    self._stats(c, run_id)
            except sqlite3.Error:
                pass  # busy or not there yet: the next look
            finally:
                c.close()
            hits = sum(h for h, _l in self._totals.values())
            lost = sum(lo for _h, lo in self._totals.values())
            self.metrics.set_totals(probe_hits=hits, lost=lost)

    def _fires(self, c: sqlite3.Connection, run_id: str) -> None:
        last = self._seen.get(run_id, 0)
        cur = c.execute(
            "SELECT seq, function, library, action, retval, ret, latency_ns FROM faults "
            "WHERE run_id=? AND seq>? ORDER BY seq",
            (run_id, last),
        )
        cols = [d[0] for d in cur.description]
        for row in cur.fetchall():
            r = dict(zip(cols, row, strict=True))
            if r["action"] == "perturb":
                if r["latency_ns"] is None:
                    break  # its window is still open: counted once, when it closes
                self._seen[run_id] = int(r["seq"])
                if not r["ret"]:
                    continue  # no bit flipped: not a fire (the step says "never fired")
            self.metrics.on_fire(r)
            self._seen[run_id] = max(self._seen.get(run_id, 0), int(r["seq"]))

    def _stats(self, c: sqlite3.Connection, run_id: str) -> None:
        if run_id in self._totals:
            return
        row = c.execute("SELECT ended, stats FROM runs WHERE run_id=?", (run_id,)).fetchone()
        if not row or not row[0]:
            return  # still running: its stats are written at its end
        try:
            st = json.loads(row[1] or "{}")
        except ValueError:
            st = {}
        lost = float(st.get("events_lost", 0) or 0) + float(st.get("fires_lost", 0) or 0)
        self._totals[run_id] = (float(st.get("calls", 0) or 0), lost)


__all__ = ["MetricsFeed"]
