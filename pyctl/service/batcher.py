"""The bounded request queue and the one worker thread that drains it.

HTTP threads `submit()` a Pending (load shedding: a full queue raises
QueueFull at once, it never blocks a client) and wait on its event with
the request's timeout. The worker, a thread named "gf-worker" (also in
/proc/PID/task/TID/comm, so `gpufault inject --tid` can find it), takes
the first waiting request, collects more for up to `batch_wait_s` or until
it has `max_batch`, and hands the batch to the service's batch function.

`last_progress` is the worker's heartbeat: it moves on every wake-up
(idle waits are bounded), every collected request and every decoding step
(through `beat()`), so a worker hung inside a call shows as a growing age
in /health, and a hang can be told from a long batch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WORKER_NAME = "gf-worker"
IDLE_WAKE_S = 0.2  # the longest the idle worker waits before beating again
_FINISH_LOCK = threading.Lock()  # one for all requests: held for two assignments


class QueueFull(Exception):
    pass


@dataclass
class Outcome:
    """What a request's HTTP thread answers: a 200 body, or an error."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Pending:
    id: str
    ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    deadline: float  # time.monotonic() after which the client got a timeout
    enqueued: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    outcome: Outcome | None = None
    # A streamed request: the worker puts each generated token id here as
    # its step ends, and None once the request is finished (finish()).
    stream: queue.SimpleQueue[int | None] | None = None
    sent: int = 0  # tokens already put on the stream (a fallback continues after them)

    def emit(self, step: int, tok: int) -> None:
        """The worker's token of `step` for a streamed request (a step
        already streamed, by a primary that then failed, is not repeated)."""
        if self.stream is not None and self.outcome is None and self.sent <= step < self.max_tokens:
            self.stream.put(tok)
            self.sent = step + 1

    def finish(self, outcome: Outcome) -> None:
        """First answer wins: the worker's, or the HTTP thread's timeout."""
        with _FINISH_LOCK:
            if self.outcome is not None:
                return
            self.outcome = outcome
        self.done.set()
        if self.stream is not None:
            self.stream.put(None)

    def expired(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) >= self.deadline


def _set_thread_comm(name: str) -> None:
    """Name the calling OS thread (PR_SET_NAME), as ps -L and gpufault see it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass  # a cosmetic failure: the Python name is still set


class Worker:
    def __init__(
        self,
        run_batch: Callable[[list[Pending]], None],
        *,
        max_batch: int,
        batch_wait_s: float,
        queue_size: int,
        on_start: Callable[[], None] | None = None,
        on_expired: Callable[[Pending], None] | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.run_batch = run_batch
        self.max_batch, self.batch_wait_s = max_batch, batch_wait_s
        self.q: queue.Queue[Pending] = queue.Queue(maxsize=queue_size)
        self.on_start = on_start
        self.on_expired = on_expired
        # Called in the worker thread after an idle wait (at most every
        # IDLE_WAKE_S): two ranks send their heartbeat collective from here,
        # the one thread that issues collectives (their order must match).
        self.on_idle = on_idle
        self.last_progress = time.monotonic()
        self.busy_since: float | None = None
        self.tid: int | None = None
        self.error: BaseException | None = None  # why the thread ended, if it did
        self._stop = threading.Event()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._main, name=WORKER_NAME, daemon=True)

    # ---- the HTTP side -----------------------------------------------------
    def submit(self, p: Pending) -> None:
        try:
            self.q.put_nowait(p)
        except queue.Full:
            raise QueueFull from None

    def depth(self) -> int:
        return self.q.qsize()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def progress_age(self) -> float:
        return time.monotonic() - self.last_progress

    # ---- lifecycle -----------------------------------------------------------
    def start(self, timeout: float = 120.0) -> None:
        """Starts the thread and returns once on_start (device set-up, warm-up)
        ran in it; raises what on_start raised."""
        self.thread.start()
        self._started.wait(timeout)
        if self.error is not None:
            raise self.error
        if not self._started.is_set():
            raise TimeoutError(f"worker did not start within {timeout:.0f} s")

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def beat(self) -> None:
        self.last_progress = time.monotonic()

    # ---- the worker thread ---------------------------------------------------
    def _main(self) -> None:
        self.tid = threading.get_native_id()
        _set_thread_comm(WORKER_NAME)
        try:
            if self.on_start is not None:
                self.on_start()
        except BaseException as e:
            self.error = e
            self._started.set()
            return
        self._started.set()
        while not self._stop.is_set():
            self.beat()
            batch = self._collect()
            if not batch:
                if self.on_idle is not None:
                    self.on_idle()
                continue
            self.busy_since = time.monotonic()
            try:
                self.run_batch(batch)
            except Exception as e:  # a bug must not kill the only worker
                for p in batch:
                    p.finish(Outcome(500, _err("internal_error", f"{type(e).__name__}: {e}")))
            finally:
                self.busy_since = None
                for p in batch:  # nothing is left waiting for its timeout
                    p.finish(Outcome(500, _err("internal_error", "request was not answered")))

    def _take(self, timeout: float) -> Pending | None:
        """The next live request, waiting up to `timeout` for the first one."""
        while True:
            try:
                p = self.q.get(timeout=timeout) if timeout > 0 else self.q.get_nowait()
            except queue.Empty:
                return None
            if not p.expired():
                return p
            # Its client has had its timeout answer already: skip the work.
            if self.on_expired is not None:
                self.on_expired(p)
            p.finish(Outcome(504, _err("timeout", "request timed out in the queue")))
            timeout = 0  # expired ones are skipped without waiting again

    def _collect(self) -> list[Pending]:
        first = self._take(IDLE_WAKE_S)
        if first is None:
            return []
        batch = [first]
        until = time.monotonic() + self.batch_wait_s
        while len(batch) < self.max_batch:
            nxt = self._take(until - time.monotonic())
            if nxt is None:
                break
            batch.append(nxt)
        self.beat()
        return batch


def _err(kind: str, message: str) -> dict[str, Any]:
    """One-line OpenAI-style error body."""
    return {"error": {"type": kind, "message": message}}


error_body = _err
