"""A session armed in several processes at once: the members a selector
resolved to (a container's processes, a job's ranks), one isolated
session each, all writing to the same evidence database (each its own
run, its targets row saying which member it is).

The group arms all or nothing: members arm in parallel, and if one
fails, the others are disarmed before the error is raised. Counters are
the members' sums; fires arrive in one stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from pyctl.api.evidence import Evidence, FaultRecord
from pyctl.api.target import Target


class SessionGroup:
    def __init__(self, sessions: list[Any]) -> None:
        self.sessions = sessions  # IsolatedSession, one per member, in member order
        self._cond = threading.Condition()
        self._fires: list[Any] = []
        self.on_fire: Callable[[Any], None] | None = None

    def arm_all(self, on_fire: Callable[[Any], None] | None = None) -> SessionGroup:
        """Launch every member's child at once, wait for each to arm; if
        one cannot, disarm the others and raise its error."""
        self.on_fire = on_fire
        for s in self.sessions:
            s.on_fire = self._fired
        try:
            for s in self.sessions:
                s.launch()  # every child arms at once
            for s in self.sessions:
                s.wait_armed()
        except BaseException:
            self.disarm()
            raise
        return self

    # --- fires -----------------------------------------------------------
    def _fired(self, f: Any) -> None:
        with self._cond:
            self._fires.append(f)
            self._cond.notify_all()
        cb = self.on_fire
        if cb is not None:
            try:
                cb(f)
            except Exception:  # noqa: BLE001 - a harness's callback never ends the run
                pass

    def fired(self) -> list[Any]:
        with self._cond:
            return sorted(self._fires, key=lambda f: f.wall)

    def wait_fires(self, n: int = 1, timeout: float | None = None) -> bool:
        """Until n faults fired across the members (True), the timeout, or
        every member ended first (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._fires) < n:
                if not self.active:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            return True

    # --- state -----------------------------------------------------------
    @property
    def db(self) -> str:
        return str(self.sessions[0].db)

    @property
    def members(self) -> list[Target]:
        return [s.target for s in self.sessions]

    @property
    def run_ids(self) -> list[str]:
        return [s.run_id for s in self.sessions]

    @property
    def counters(self) -> Any:
        """The members' Counters, summed (a Counters)."""
        cs = [s.counters for s in self.sessions]
        return type(cs[0])(sum(c.calls for c in cs), sum(c.fires for c in cs),
                        sum(c.lost for c in cs), sum(c.unfinished for c in cs))  # fmt: skip

    @property
    def calls(self) -> int:
        return int(self.counters.calls)

    @property
    def fires(self) -> int:
        return int(self.counters.fires)

    @property
    def lost(self) -> int:
        return int(self.counters.lost)

    @property
    def active(self) -> bool:
        return any(s.active for s in self.sessions)

    @property
    def status(self) -> str:
        states = {s.status for s in self.sessions}
        return states.pop() if len(states) == 1 else "mixed"

    def wait(self, timeout: float | None = None) -> bool:
        """Until every member ended by itself (deadline, target's end)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for s in self.sessions:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not s.wait(left):
                return False
        return True

    def faults(self) -> list[FaultRecord]:
        """Every member's faults, in fire order."""
        ids = [r for r in self.run_ids if r]
        if not ids:
            return []
        with Evidence(self.db) as ev:
            rows = [f for r in ids for f in ev.faults(r)]
        return sorted(rows, key=lambda f: f.wall or 0.0)

    def disarm(self) -> None:
        """Every member at once: ask each to stop, then wait for each."""
        for s in self.sessions:
            s.stop()
        for s in self.sessions:
            s.disarm()

    def close(self) -> None:
        self.disarm()

    def __enter__(self) -> SessionGroup:
        return self

    def __exit__(self, *_: object) -> None:
        self.disarm()

    def __repr__(self) -> str:
        c = self.counters
        return (f"<gpufault session group of {len(self.sessions)} ({self.status}): "
                f"{c.calls} calls, {c.fires} fires, {c.lost} lost>")  # fmt: skip


__all__ = ["SessionGroup"]
