"""Dead-man leases: every session the agent arms for a controller holds
one; the controller renews it, and when renewals stop (the controller was
killed, the link is cut) the watcher calls `expire` for it at once.

One thread sleeps on a condition until the earliest expiry (no polling
period to add to the latency): a renewal or a new lease wakes it to
recompute. Times are CLOCK_MONOTONIC: a wall-clock step neither ends nor
extends a lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MIN_LEASE_S = 0.2  # renewals every lease/3: below this a busy host misses them
MAX_LEASE_S = 3600.0


@dataclass
class Lease:
    key: str
    lease_s: float
    expires: float  # monotonic
    renewed: float  # monotonic, last renewal (or the grant)
    renewals: int = 0
    expired_at: float | None = None  # monotonic, when the watcher ended it


class Leases:
    def __init__(self, expire: Callable[[Lease], None]) -> None:
        self._expire = expire
        self._leases: dict[str, Lease] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="gf-agent-lease", daemon=True)
        self._thread.start()

    def grant(self, key: str, lease_s: float) -> Lease:
        now = time.monotonic()
        lease = Lease(key, lease_s, now + lease_s, now)
        with self._cond:
            self._leases[key] = lease
            self._cond.notify_all()
        return lease

    def renew(self, key: str) -> Lease | None:
        """The lease extended by its interval from now; None when it is
        gone (expired or released): the controller must know its fault is off."""
        with self._cond:
            lease = self._leases.get(key)
            if lease is None:
                return None
            now = time.monotonic()
            lease.expires, lease.renewed = now + lease.lease_s, now
            lease.renewals += 1
            self._cond.notify_all()
            return lease

    def release(self, key: str) -> Lease | None:
        with self._cond:
            lease = self._leases.pop(key, None)
            self._cond.notify_all()
            return lease

    def get(self, key: str) -> Lease | None:
        with self._cond:
            return self._leases.get(key)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5)

    def _watch(self) -> None:
        while True:
            due: list[Lease] = []
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                for k, lease in list(self._leases.items()):
                    if lease.expires <= now:
                        lease.expired_at = now
                        due.append(self._leases.pop(k))
                if not due:
                    nxt = min((x.expires for x in self._leases.values()), default=None)
                    self._cond.wait(None if nxt is None else max(nxt - now, 0.0))
                    continue
            for lease in due:  # outside the lock: expire() may block briefly
                try:
                    self._expire(lease)
                except Exception:  # noqa: BLE001 - one session's end never stops the watcher
                    pass


__all__ = ["MAX_LEASE_S", "MIN_LEASE_S", "Lease", "Leases"]
