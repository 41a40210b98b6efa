"""A circuit breaker over the primary model's device.

closed     every batch runs on the primary model; N consecutive device
           errors within `window_s` trip it open.
open       batches go to the degradation path (fallback model or 503);
           after `cooldown_s` the next batch is a probe (half-open).
half-open  one probe batch runs on the primary model: success closes the
           breaker, a device error opens it again for another cooldown.

The worker is the only thread that changes the state (one batch at a
time, so half-open never has two probes); HTTP threads only read it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, HALF_OPEN, OPEN = "closed", "half-open", "open"
# The gauge's values (docs/service.md): 0 closed, 1 half-open, 2 open.
STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


@dataclass
class BreakerSnapshot:
    state: str
    consecutive_errors: int
    trips: int
    opened_for_s: float | None  # how long it has been open (None while closed)
    last_error: str | None


class CircuitBreaker:
    def __init__(
        self,
        errors: int,
        window_s: float,
        cooldown_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, str], None] | None = None,
    ) -> None:
        self.errors, self.window_s, self.cooldown_s = errors, window_s, cooldown_s
        self.clock = clock
        self.on_change = on_change
        self._lock = threading.Lock()
        self._state = CLOSED
        self._recent: deque[float] = deque()  # times of the current run of errors
        self._opened_at = 0.0
        self._trips = 0
        self._last_error: str | None = None

    @property
    def state(self) -> str:
        return self._state

    def _set(self, new: str) -> None:
        old, self._state = self._state, new
        if old != new and self.on_change is not None:
            self.on_change(old, new)

    def use_primary(self) -> bool:
        """Whether the next batch runs on the primary model (a probe if half-open)."""
        with self._lock:
            if self._state == OPEN and self.clock() - self._opened_at >= self.cooldown_s:
                self._set(HALF_OPEN)
            return self._state != OPEN

    def success(self) -> None:
        with self._lock:
            self._recent.clear()
            if self._state == HALF_OPEN:
                self._set(CLOSED)

    def failure(self, what: str) -> None:
        """A device error of a primary batch."""
        with self._lock:
            now = self.clock()
            self._last_error = what
            if self._state == HALF_OPEN:
                self._open(now)
                return
            self._recent.append(now)
            while self._recent and now - self._recent[0] > self.window_s:
                self._recent.popleft()
            if self._state == CLOSED and len(self._recent) >= self.errors:
                self._open(now)

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._trips += 1
        self._recent.clear()
        self._set(OPEN)

    def snapshot(self) -> BreakerSnapshot:
        with self._lock:
            return BreakerSnapshot(
                state=self._state,
                consecutive_errors=len(self._recent),
                trips=self._trips,
                opened_for_s=None
                if self._state == CLOSED
                else round(self.clock() - self._opened_at, 3),
                last_error=self._last_error,
            )
