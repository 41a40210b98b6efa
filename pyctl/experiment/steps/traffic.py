"""Traffic steps: a second open-loop load for the step's duration, where
the adversarial input is the fault (a corpus of pyctl/experiment/corpora.py:
unicode, over-limit, cold words, ...). Its requests are its fires; after the
run every answer must have a status in ok_status (up to max_bad outside).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from pyctl.experiment import corpora
from pyctl.experiment.model import Step, Traffic
from pyctl.experiment.reader import LOAD_KEYS, Reader, load_fields
from pyctl.experiment.steps.base import EndsOnItsOwn, StepKind, register

if TYPE_CHECKING:
    from pyctl.experiment.steps.base import Run, StepRun


class TrafficRun(EndsOnItsOwn):
    """A traffic step (a second open-loop load for the step's duration)
    behind the RunningFault interface: its requests are its fires."""

    run_id = ""  # no controller, no runs row

    def __init__(self, url: str, step: Step, cases: list[tuple[str, bytes]] | None) -> None:
        # lazy: keeps pyctl.experiment.loadgen (queue, +5 modules) off `--help`
        from pyctl.experiment.loadgen import OpenLoopLoad

        t = step.traffic
        assert t is not None
        self.traffic = t
        self.names = [n for n, _b in cases] if cases else ["prompt"]
        bodies = [b for _n, b in cases] if cases else None
        self.load = OpenLoopLoad(
            t.endpoint(url),
            t.rate,
            prompt=t.prompt,
            max_tokens=t.max_tokens,
            timeout=t.timeout,
            concurrency=t.concurrency,
            duration=step.duration,
            bodies=bodies,
            method=t.method,
            headers=t.resolved_headers(f"traffic step {step.name!r}"),
            stream=t.stream,
            arrival=t.arrival,
            realtime=t.realtime,
        )
        n = len(bodies) if bodies else 1
        self.what = f"sending ({corpora.describe(t)}, {n} bodies, {t.plan().describe()}"
        self._ended_at: float | None = None
        self._done = threading.Event()
        self.started_at = time.time()
        self.load.start()
        self._waiter = threading.Thread(target=self._run, name="gf-exp-traffic", daemon=True)
        self._waiter.start()

    def _run(self) -> None:
        self.load.wait()
        self.load.stop()  # the requests already due are answered or time out
        self._ended_at = time.time()
        self._done.set()

    def stop(self) -> None:
        # Not load.stop() here: it waits for answers, and an abort stops
        # every step at once from the guard's thread.
        self.load.halt()

    def fires(self) -> list[tuple[str, float]]:
        return [(f"request-{x.index}", x.sent) for x in self.load.samples() if x.sent]

    def check(self) -> tuple[bool, dict[str, Any], str]:
        """Every answer within ok_status (up to max_bad of them outside)?"""
        t = self.traffic
        lo, hi = t.ok_status
        got = self.load.samples()
        kinds = Counter(str(x.status) if x.status else x.error for x in got)
        bad = [x for x in got if not lo <= x.status <= hi]
        ok = bool(got) and len(bad) <= t.max_bad * len(got)
        # Which cases got them: the finding a user acts on.
        which = Counter(
            f"{self.names[x.index % len(self.names)]} {x.status or x.error}" for x in bad
        )
        cases = ", ".join(k for k, _v in which.most_common(6))
        more = f" +{len(which) - 6} more" if len(which) > 6 else ""
        detail = (
            f"{len(bad)} of {len(got)} answers outside [{lo}, {hi}] "
            f"({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})"
            + (f"; bad: {cases}{more}" if bad else "")
        )
        return (
            ok,
            {"answers": dict(kinds), "bad": len(bad), "sent": len(got), "bad_cases": sorted(which)},
            detail,
        )


def parse_traffic(r: Reader, key: str, v: Any) -> Traffic:
    if not isinstance(v, dict):
        raise r.err(key, 'expected a table {corpus = "unicode", rate = 10, ...}')
    r.keys(v, key, LOAD_KEYS | {"ok_status", "max_bad"})
    fields = load_fields(r, v, key)
    ok = v.get("ok_status", [200, 499])
    if (
        not isinstance(ok, list)
        or len(ok) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in ok)
        or not 100 <= ok[0] <= ok[1] <= 599
    ):
        raise r.err(f"{key}.ok_status", f"{ok!r}: give a status range such as [200, 499]")
    bad = v.get("max_bad", 0)
    if isinstance(bad, str) and bad.strip().endswith("%"):
        try:
            bad = float(bad.strip()[:-1]) / 100
        except ValueError:
            pass
    if isinstance(bad, bool) or not isinstance(bad, (int, float)) or not 0 <= bad < 1:
        raise r.err(f"{key}.max_bad", f'{v.get("max_bad")!r}: give a share such as "1%" or 0')
    return Traffic(**fields, ok_status=(ok[0], ok[1]), max_bad=float(bad))


class TrafficKind(StepKind):
    name = "traffic"
    words = ("traffic",)
    refused = ("thread", "pid", "tid", "arm_timeout")
    why = "a traffic step sends requests: remove it"

    def parse(self, r: Reader, key: str, m: dict[str, Any], step: Step) -> Step:
        traffic = parse_traffic(r, f"{key}.traffic", m["traffic"])
        step.name = r.str_(m, key, "name", f"traffic {traffic.corpus}")
        step.thread, step.traffic = None, traffic
        return step

    def prepare(self, run: Run, step: Step, facts: dict[str, Any]) -> None:
        assert step.traffic is not None
        n = step.traffic.expected_requests(step.duration)
        run.traffic_bodies[step.idx] = corpora.cases(step.traffic, n)

    def launch(self, run: Run, sr: StepRun, facts: dict[str, Any]) -> Any:
        with run.lock:
            child = TrafficRun(facts["url"], sr.step, run.traffic_bodies.get(sr.step.idx))
            run.launching.append(child)
        return child

    def arm(self, run: Run, sr: StepRun, pending: Any, facts: dict[str, Any]) -> Any:
        return pending  # sending from now on: nothing to arm

    def spec(self, step: Step) -> dict[str, Any]:
        assert step.traffic is not None
        d = asdict(step.traffic)
        d["ok_status"] = list(step.traffic.ok_status)
        return {"traffic": d}

    def check(self, f: Any) -> tuple[bool, dict[str, Any], str] | None:
        return f.check() if isinstance(f, TrafficRun) else None


register(TrafficKind())

__all__ = ["TrafficKind", "TrafficRun", "parse_traffic"]
