"""Open-loop HTTP load: requests on a planned schedule, each timed from when it was due.

Why open loop: a closed-loop client (send, wait for the answer, send the
next) stops sending while the server stalls, so a 1 s stall shows in one
sample instead of in the 200 requests that should have gone out meanwhile
(coordinated omission; the wrk2 and vegeta model). Here one scheduler
thread emits request i at t0 + i/rate (or the i-th planned time of a
Poisson or burst arrival, pyctl/experiment/arrival.py), an absolute
deadline (a late wake-up does not shift the requests after it), into a
queue that a pool of worker threads with keep-alive connections serves.
A request's latency
is done - due: the time it waited for a free connection, or for the
scheduler to wake up, counts, so a stall of the server shows in the
latency of every request due during it even when the generator could not
send them (all connections busy). A closed loop (arrival kind "closed",
N clients, the benchmark_serving / LLMPerf concurrency mode) is here too,
for what N concurrent users see; its requests are due when sent.

    load = OpenLoopLoad("http://127.0.0.1:8000", rate=200)
    load.start(); ...; load.stop()
    window_stats(load.samples(), t_fault, t_fault + 10)   # p50/p95/p99, error rate

Stdlib only (sockets, threads; a small HTTP/1.1 client that reads the
kernel's arrival time of each answer, below). Times in Samples are time.time()
values derived from time.monotonic() (one offset taken at start), so
latencies are immune to wall-clock steps and comparable with other
time.time() stamps of the experiment.
"""

from __future__ import annotations

import json
import math
import queue
import socket
import threading
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pyctl import threadsched
from pyctl.exceptions import BadInput
from pyctl.experiment.arrival import Arrival

_clock = time.monotonic
CLOSED_BACKOFF = 0.01  # s a closed-loop client waits after a connection error
# The load threads ask to be run on time (OpenLoopLoad._realtime,
# pyctl/threadsched.py) only up to RT_MAX_RATE requests/s: the
# generator costs ~0.5 ms of CPU a request (0.08-0.10 CPU-s/s at 200/s),
# so there it takes at most a quarter of a core ahead of the normal
# threads, the service's among them.
RT_MAX_RATE = 500.0


@dataclass(frozen=True)
class Sample:
    """One request."""

    due: float  # time.time() when it should have been sent (open loop)
    done: float  # when its answer (or error) arrived
    latency: float  # done - due, seconds (coordinated-omission free)
    status: int  # HTTP status, 0 for a connection error / timeout
    error: str  # "" or a short kind: "timeout", "conn", "http-503"
    sent: float = 0.0  # when it was handed to the socket; 0.0 if never sent
    index: int = 0  # request i of the run (with `bodies`: it sent bodies[i % len])
    # A streamed answer (stream=True): the first token's arrival - due
    # (NaN when no token came), the gaps between token chunks (seconds),
    # the output tokens (the usage chunk's completion_tokens, else the
    # token chunks counted); the text, when the load keeps it (keep_text).
    ttft: float = math.nan
    itl: tuple[float, ...] = ()
    tokens: int = 0
    text: str = ""

    @property
    def tpot(self) -> float:
        """Time per output token after the first ((latency - ttft) / (tokens
        - 1), vLLM's TPOT); NaN with fewer than two tokens."""
        if self.tokens < 2 or math.isnan(self.ttft):
            return math.nan
        return (self.latency - self.ttft) / (self.tokens - 1)

    @property
    def lag(self) -> float:
        """Schedule lag: sent - due (scheduler wake-up + wait for a free
        connection); 0.0 for a request that was never sent."""
        return self.sent - self.due if self.sent else 0.0

    @property
    def ok(self) -> bool:
        return not self.error


class LoadError(BadInput):
    """Bad arguments for the load generator; str() is one line saying what to do."""


class OpenLoopLoad:
    """Requests on a plan (by default `rate` per second) until stop(); see
    the module docstring.

    `arrival` (pyctl/experiment/arrival.py) says when requests start:
    constant at `rate` (the default), poisson, bursts, or a closed loop of
    N clients (then `concurrency` is N and `rate` is not used).
    `url` is the service's base URL (`path` is appended) or, when it has a
    path of its own, the full endpoint (then `path` is ignored). The body
    is the OpenAI completion request {"prompt", "max_tokens"} for POST, or
    `body` when given. stream: the answers are Server-Sent Events (OpenAI's
    `data: {chunk}` ... `data: [DONE]`); each Sample then has the time to
    its first token, the gaps between tokens and the output tokens, read
    as the chunks arrive (keep_text: and the text, for a quality check).
    `timeout` bounds each request from its due time: one not answered by
    due + timeout is an error "timeout" (also one that
    waited that long for a free connection: a real client gives up too, and
    it keeps a dead server from building an endless backlog).
    """

    def __init__(
        self,
        url: str,
        rate: float,
        *,
        prompt: str = "hello",
        max_tokens: int = 4,
        timeout: float = 5.0,
        path: str = "/v1/completions",
        concurrency: int = 64,
        method: str = "POST",
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        duration: float | None = None,
        bodies: Sequence[bytes] | None = None,
        stream: bool = False,
        keep_text: bool = False,
        arrival: Arrival | None = None,
        realtime: bool | str = True,
    ) -> None:
        if arrival is None:
            if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
                raise LoadError(f"load rate {rate!r} must be a positive number of requests/s")
            arrival = Arrival("constant", rate=float(rate))
        self.arrival = arrival
        if arrival.kind == "closed":
            concurrency = arrival.clients  # one connection per client
        elif arrival.kind == "burst" and arrival.size > concurrency:
            raise LoadError(
                f"a burst of {arrival.size} needs as many connections: give concurrency >= "
                f"{arrival.size} (it is {concurrency})"
            )
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise LoadError(f"load timeout {timeout!r} must be a positive number of seconds")
        if not (isinstance(concurrency, int) and concurrency >= 1):
            raise LoadError(f"load concurrency {concurrency!r} must be an integer >= 1")
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise LoadError(
                f"load url {url!r} is not an http(s) URL (use e.g. http://127.0.0.1:8000)"
            )
        self.url = url
        self.rate = arrival.mean_rate or float(rate)
        self.timeout = float(timeout)
        self.concurrency = concurrency
        self.duration = duration
        self.method = method.upper()
        self._https = u.scheme == "https"
        self._host = u.hostname
        try:
            self._port = u.port or (443 if self._https else 80)
        except ValueError as e:
            raise LoadError(f"load url {url!r}: {e} (use e.g. http://127.0.0.1:8000)") from None
        own = u.path if u.path not in ("", "/") else ""
        self._path = (own or path) + (f"?{u.query}" if u.query else "")
        if bodies is not None and (not bodies or body is not None):
            raise LoadError("give either body or a non-empty list of bodies, not both")
        if body is None and bodies is None and self.method == "POST":
            default: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens}
            if stream:
                default["stream"] = True
            body = json.dumps(default).encode()
        self._body = body
        self.stream = stream
        self.keep_text = keep_text
        # Every request's bytes built once, sent with one sendall(); request
        # i sends the (i % n)th of them (a prompt mix: `bodies`).
        self._requests = [
            self._build(u.netloc, b, headers) for b in (bodies if bodies is not None else [body])
        ]
        self._request = self._requests[0]
        self._q: queue.SimpleQueue[tuple[float, int] | None] = queue.SimpleQueue()
        self._headers = dict(headers or {})
        self._samples: list[Sample] = []
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._sched_lag: list[float] = []  # scheduler wake-up - due, per request
        self._stop = threading.Event()
        self._go = threading.Event()  # set once t0 is known
        self._threads: list[threading.Thread] = []
        self._sched: threading.Thread | None = None
        if realtime not in (True, False, "slice"):
            raise LoadError(f'load realtime {realtime!r}: give true, false or "slice"')
        self.realtime = realtime
        rate_ = arrival.mean_rate or self.rate
        self._rt_workers = bool(realtime) and rate_ <= RT_MAX_RATE and arrival.open_loop
        # What the scheduler thread got: "fifo", or "other" with why not.
        self.sched_policy = "other"
        self._mono0 = self._wall0 = 0.0
        self._in_flight = 0

    def _build(self, netloc: str, body: bytes | None, headers: dict[str, str] | None) -> bytes:
        hdrs = {"Host": netloc, "User-Agent": "gpufault-loadgen", "Connection": "keep-alive"}
        if body is not None:
            hdrs.update({"Content-Type": "application/json", "Content-Length": str(len(body))})
        hdrs.update(headers or {})
        head = f"{self.method} {self._path} HTTP/1.1\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in hdrs.items()
        )
        return head.encode("latin-1") + b"\r\n" + (body or b"")

    # ---- control -------------------------------------------------------------

    def start(self) -> None:
        if self._sched is not None:
            raise RuntimeError("OpenLoopLoad.start() called twice")
        self._wall0, self._mono0 = time.time(), _clock()
        closed = not self.arrival.open_loop
        work = self._closed_worker if closed else self._worker
        for i in range(self.concurrency):
            t = threading.Thread(target=work, name=f"gf-load-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        # The first request is due a little after the workers exist, not at
        # once: their start-up would otherwise be charged to request 0.
        self._t0 = _clock() + 0.005
        self._go.set()  # closed-loop clients start at t0
        # Closed loop: this thread only marks the end of `duration` (wait()).
        sched = self._closed_clock if closed else self._schedule
        self._sched = threading.Thread(target=sched, name="gf-load-sched", daemon=True)
        self._sched.start()

    def stop(self) -> None:
        """Stop sending new requests; wait for the ones already due.

        Those still queued (every connection was busy) are sent or, past
        their deadline, recorded as timeouts, so this returns within about
        `timeout`: each request's deadline is its due time + timeout, and
        none falls due after this call."""
        if self._sched is None:
            return
        self._stop.set()
        self._sched.join()
        for _ in self._threads:
            self._q.put(None)  # FIFO: behind every queued request
        deadline = _clock() + self.timeout + 1.0
        for t in self._threads:
            t.join(max(0.0, deadline - _clock()))

    def halt(self) -> None:
        """Stop scheduling new requests, without waiting for the ones due
        (stop() waits; this is for a caller that must not block)."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """With `duration`: wait until the scheduler has emitted its last
        request (then call stop()); True if it has."""
        if self._sched is None:
            return False
        self._sched.join(timeout)
        return not self._sched.is_alive()

    def __enter__(self) -> OpenLoopLoad:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- results -------------------------------------------------------------

    def samples(self, since: float = 0, until: float = float("inf")) -> list[Sample]:
        """Finished requests with since <= due < until, by due time."""
        with self._lock:
            out = [s for s in self._samples if since <= s.due < until]
        out.sort(key=lambda s: s.due)
        return out

    def counts(self) -> dict[str, Any]:
        """Counters: scheduled, sent, answered (an HTTP status came back), ok,
        errors by kind, in flight, backlog, and the schedule lag (the
        scheduler's wake-up after each due time, which is what the GIL and
        the timer cost: p50/p99/max in ms)."""
        with self._lock:
            c = dict(self._counts)
            lags = sorted(self._sched_lag)
            in_flight = self._in_flight
        errors = {k[4:]: v for k, v in c.items() if k.startswith("err:")}
        return {
            "scheduled": c.get("scheduled", 0),
            "sent": c.get("sent", 0),
            "answered": c.get("answered", 0),
            "ok": c.get("ok", 0),
            "errors": errors,
            "in_flight": in_flight,
            "backlog": self._q.qsize(),
            "sched_policy": self.sched_policy,
            "sched_lag_ms": {
                "p50": _q(lags, 0.50) * 1e3 if lags else None,
                "p99": _q(lags, 0.99) * 1e3 if lags else None,
                "max": lags[-1] * 1e3 if lags else None,
            },
        }

    # ---- threads -------------------------------------------------------------

    def _wall(self, mono: float) -> float:
        return self._wall0 + (mono - self._mono0)

    def _end(self) -> float:
        return self._t0 + self.duration if self.duration is not None else math.inf

    def _realtime(self) -> None:
        """Ask for SCHED_FIFO for this (the scheduler's) thread, and so for
        the workers (_worker_realtime), best effort.

        Why: on a shared 2-core host, with every core busy, a normal
        thread's timed wait returned 4-12 ms late at the p99 (the
        scheduler's error at 200 requests/s) and a worker woke as late to
        send; real-time, the error was 0.1 ms and the send lag 0.3 ms
        (bench/bench_loadgen_arrival.py, docs/benchmarks.md "Arrivals").
        The workers take the policy for good, not only for the send: a
        thread that drops to normal while it holds the GIL is preempted
        there, and every real-time thread then waits for it (measured:
        worse than no real-time at all). What that costs the service under
        test is the generator's own CPU (0.1 core at 200 requests/s), now
        run ahead of it rather than beside it; hence the rate cap. Without
        CAP_SYS_NICE, or with `realtime = "slice"`, the threads ask for a
        0.1 ms EEVDF slice instead (Linux 6.12+, no privilege:
        threadsched.py); above RT_MAX_RATE or with `realtime = false` they
        stay normal. `counts()["sched_policy"]` says which and why."""
        self.sched_policy = self._prioritize()

    def _prioritize(self) -> str:
        """This thread on time as the settings allow; what it got, in words."""
        if not self.realtime:
            return "other (realtime = false)"
        rate = self.arrival.mean_rate or self.rate
        if rate > RT_MAX_RATE:
            return f"other ({rate:g}/s is above the {RT_MAX_RATE:g}/s real-time cap)"
        if self.realtime == "slice":
            why = threadsched.short_slice()
            ms = f"{threadsched.SLICE_NS / 1e6:g} ms"
            return f"other, {ms} slice (realtime = slice)" if why is None else f"other ({why})"
        return threadsched.prioritize()

    def _schedule(self) -> None:
        self._realtime()
        end = self._end()
        plan = self.arrival.offsets()
        i = 0
        due = self._t0 + next(plan)  # absolute: drift does not accumulate
        while due < end:
            now = _clock()
            if due > now:
                if self._stop.wait(due - now):  # an interruptible sleep
                    return
                now = _clock()
            elif self._stop.is_set():
                return
            # Everything due by now goes out in one hand-off, stamped with
            # this one wake-up: a burst's 20 requests (or Poisson's close
            # gaps) are not charged for the puts and GIL switches of the
            # ones before them. Behind schedule (a GC pause, a busy core):
            # emitted at once, with their planned due times, so the delay
            # counts in the latency.
            batch = [due]
            due = self._t0 + next(plan)
            while due <= now and due < end:
                batch.append(due)
                due = self._t0 + next(plan)
            with self._lock:
                self._sched_lag.extend(now - d for d in batch)
                self._counts["scheduled"] += len(batch)
            for d in batch:
                self._q.put((d, i))
                i += 1

    def _closed_clock(self) -> None:
        self.sched_policy = "other (closed loop: no schedule to keep)"
        end = self._end()
        self._stop.wait(max(0.0, end - _clock()) if end < math.inf else None)

    def _closed_worker(self) -> None:
        """A closed-loop client: the next request as soon as the last one is
        answered; it is due when it is sent (no schedule to fall behind)."""
        conn: _Conn | None = None
        self._go.wait()
        end = self._end()
        wait = self._t0 - _clock()
        if wait > 0 and self._stop.wait(wait):
            return
        try:
            while not self._stop.is_set():
                due = _clock()
                if due >= end:
                    return
                with self._lock:
                    i = self._counts["scheduled"]
                    self._counts["scheduled"] += 1
                    refused = self._counts["err:conn"]
                conn = self._one(due, conn, i)
                with self._lock:
                    refused = self._counts["err:conn"] - refused
                # A refused connection answers at once: without a pause a
                # client would spin on a dead server, a core at 100 %.
                if refused and self._stop.wait(CLOSED_BACKOFF):
                    return
        finally:
            if conn is not None:
                conn.close()

    def _record(
        self,
        due: float,
        done: float,
        status: int,
        error: str,
        sent: float,
        index: int = 0,
        sink: _SSE | _Body | None = None,
    ) -> None:
        extra: dict[str, Any] = {}
        if isinstance(sink, _Body):
            extra = {"text": sink.text()}
        elif sink is not None:
            sse = sink
            if sse.error and not error:
                error = "stream-error"  # an error event inside a 200 stream
            elif status == 200 and not error and not sse.done:
                error = "stream-cut"  # the stream ended without [DONE]
            at = sse.token_at
            extra = {
                "ttft": at[0] - due if at else math.nan,
                "itl": tuple(b - a for a, b in zip(at, at[1:], strict=False)),
                "tokens": sse.usage if sse.usage is not None else len(at),
                "text": "".join(sse.texts) if self.keep_text else "",
            }
        s = Sample(
            due=self._wall(due),
            done=self._wall(done),
            latency=done - due,
            status=status,
            error=error,
            sent=self._wall(sent) if sent else 0.0,
            index=index,
            **extra,
        )
        with self._lock:
            self._samples.append(s)
            if status:
                self._counts["answered"] += 1
            if error:
                self._counts["err:" + error] += 1
            else:
                self._counts["ok"] += 1

    def _worker_realtime(self) -> None:
        """A worker thread asks for what the scheduler asks for (SCHED_FIFO,
        else the short slice) for its whole life (see _realtime for why);
        the same settings give it the same answer."""
        if self._rt_workers:
            self._prioritize()  # what it got: as the scheduler's, counts()["sched_policy"]

    def _worker(self) -> None:
        conn: _Conn | None = None
        try:
            self._worker_realtime()
            while True:
                item = self._q.get()
                if item is None:
                    return
                conn = self._one(item[0], conn, item[1])
        finally:
            if conn is not None:
                conn.close()

    def _one(self, due: float, conn: _Conn | None, index: int = 0) -> _Conn | None:
        deadline = due + self.timeout
        status, error, sent, done = 0, "", 0.0, 0.0
        sink: _SSE | _Body | None = None
        for attempt in (0, 1):
            sink = _SSE() if self.stream else _Body() if self.keep_text else None
            left = deadline - _clock()
            if left <= 0:
                error = "timeout"
                break
            reused = conn is not None
            try:
                if conn is None:
                    conn = _Conn(self._host, self._port, left, self._https)
                if not sent:
                    sent = _clock()
                    with self._lock:
                        self._counts["sent"] += 1
                        self._in_flight += 1
                request = self._requests[index % len(self._requests)]
                status, close, done = conn.exchange(request, deadline, sink)
                error = "" if 200 <= status < 300 else f"http-{status}"
                if close:
                    conn.close()
                    conn = None
                break
            except TimeoutError:
                error = "timeout"
            except _Stale:
                error = "conn"
                if attempt == 0 and reused:
                    # A keep-alive connection the server closed while it was
                    # idle fails on first use: reconnect once, as urllib3 does.
                    conn.close()  # type: ignore[union-attr]
                    conn = None
                    continue
            except (OSError, ValueError):
                error = "conn"
            if conn is not None:
                conn.close()
                conn = None
            break
        if not done:
            done = _clock()
        if sent:
            with self._lock:
                self._in_flight -= 1
        if sink is not None and not 200 <= status < 300:
            sink = None  # an error answer's body is no stream and no text
        self._record(due, done, status, error, sent, index, sink)
        return conn


# ---- a minimal HTTP/1.1 client ---------------------------------------------------
#
# Not http.client: the answer's arrival is read from the kernel (SO_TIMESTAMPNS:
# when the last segment of the answer reached this host's socket), not from
# when this thread got the CPU and the GIL to look at it. On a 2-core machine
# shared with the service, that wake-up is milliseconds at the p99, which
# would be charged to the server. The send side stays as measured from the
# due time: a generator that sends late must show it, not hide it.

_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux asm-generic value
_TS_SPACE = socket.CMSG_SPACE(16)  # struct timespec


class _Stale(ConnectionError):
    """The server closed the connection before any byte of the answer."""


class _Conn:
    """One keep-alive connection; exchange() sends a request, reads its answer."""

    def __init__(self, host: str, port: int, timeout: float, https: bool) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.kernel_ts = not https  # an SSL socket has no recvmsg
        if https:
            # lazy: ssl (base64, +3 modules) only when this runs
            import ssl

            self.sock = ssl.create_default_context().wrap_socket(self.sock, server_hostname=host)
        else:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            except OSError:
                self.kernel_ts = False
        self.buf = b""  # bytes read past the last answer
        self.at = 0.0

    def close(self) -> None:
        self.sock.close()

    def _recv(self, deadline: float) -> bytes:
        """Some bytes; self.at = when they arrived (monotonic clock)."""
        left = deadline - _clock()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)
        if not self.kernel_ts:
            data = self.sock.recv(65536)
            self.at = _clock()
            return data
        data, anc, _flags, _addr = self.sock.recvmsg(65536, _TS_SPACE)
        now_m, now_w = _clock(), time.time()
        self.at = now_m
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(raw) >= 16:
                sec = int.from_bytes(raw[:8], "little")
                nsec = int.from_bytes(raw[8:16], "little")
                at = now_m - (now_w - (sec + nsec * 1e-9))  # realtime stamp -> monotonic
                if now_m - 1.0 < at <= now_m:  # sane (a clock step would not be)
                    self.at = at
        return data

    def _line(self, deadline: float) -> bytes:
        while b"\r\n" not in self.buf:
            self._more(deadline)
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def _more(self, deadline: float) -> None:
        data = self._recv(deadline)
        if not data:
            raise ConnectionError("the server closed the connection inside an answer")
        self.buf += data

    def exchange(
        self, request: bytes, deadline: float, sink: _SSE | _Body | None = None
    ) -> tuple[int, bool, float]:
        """(status, whether the server closes the connection, arrival time);
        sink gets the body's bytes as they arrive, with their arrival time."""
        if self.buf:
            raise ValueError("bytes the server sent unasked")
        try:
            self.sock.sendall(request)
            data = self._recv(deadline)
        except (BrokenPipeError, ConnectionResetError):
            raise _Stale from None
        if not data:
            raise _Stale
        self.buf = data
        while True:  # skip 1xx interim answers
            status_line = self._line(deadline).decode("latin-1")
            parts = status_line.split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
                raise ValueError(f"not an HTTP answer: {status_line[:40]!r}")
            status = int(parts[1])
            hdr: dict[str, str] = {}
            while line := self._line(deadline):
                k, _, v = line.decode("latin-1").partition(":")
                hdr[k.strip().lower()] = v.strip()
            if not 100 <= status < 200:
                break
        close = hdr.get("connection", "").lower() == "close" or parts[0] == "HTTP/1.0"
        if "content-length" in hdr:
            n = int(hdr["content-length"])
            if sink is None:
                while len(self.buf) < n:
                    self._more(deadline)
            else:
                got = 0
                while True:
                    part = self.buf[: n - got]
                    self.buf = self.buf[len(part) :]
                    got += len(part)
                    if part:
                        sink.feed(part, self.at)
                    if got >= n:
                        break
                    self._more(deadline)
                n = 0
            self.buf = self.buf[n:]
        elif "chunked" in hdr.get("transfer-encoding", "").lower():
            while size := int(self._line(deadline).split(b";")[0], 16):
                while len(self.buf) < size + 2:  # the chunk and its CRLF
                    self._more(deadline)
                if sink is not None:
                    sink.feed(self.buf[:size], self.at)
                self.buf = self.buf[size + 2 :]
            while self._line(deadline):  # trailers end with an empty line
                pass
        else:  # the body runs to the end of the connection
            close = True
            if self.buf and sink is not None:
                sink.feed(self.buf, self.at)
            while data := self._recv(deadline):
                if sink is not None:
                    sink.feed(data, self.at)
            self.buf = b""
        return status, close, self.at


class _SSE:
    """Server-Sent Events of an OpenAI-style stream, parsed as they arrive:
    every `data: {chunk}` whose choices[0] has text (`text`, or chat's
    `delta.content`) is a token chunk, stamped with the arrival time of the
    bytes that completed it; a `usage` (the last chunk's, or
    include_usage's own) gives the output tokens; `data: [DONE]` ends it;
    an `error` object is an error inside the stream."""

    __slots__ = ("buf", "token_at", "texts", "usage", "done", "error")

    def __init__(self) -> None:
        self.buf = b""
        self.token_at: list[float] = []
        self.texts: list[str] = []
        self.usage: int | None = None
        self.done = False
        self.error = ""

    def feed(self, data: bytes, at: float) -> None:
        self.buf += data
        while True:
            # Events end with a blank line (LF LF, or CR LF CR LF).
            i, j = self.buf.find(b"\n\n"), self.buf.find(b"\r\n\r\n")
            if i < 0 and j < 0:
                return
            if j >= 0 and (i < 0 or j < i):
                ev, self.buf = self.buf[:j], self.buf[j + 4 :]
            else:
                ev, self.buf = self.buf[:i], self.buf[i + 2 :]
            self._event(ev, at)

    def _event(self, ev: bytes, at: float) -> None:
        data = b"\n".join(
            ln[5:].lstrip(b" ") for ln in ev.replace(b"\r\n", b"\n").split(b"\n")
            if ln.startswith(b"data:")
        )  # fmt: skip
        if not data:
            return  # a comment, an id or a retry line
        if data.strip() == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            self.error = self.error or "not JSON"
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            self.error = self.error or str(obj["error"])[:200]
            return
        text = _choice_text(obj, stream=True)
        if text:
            self.token_at.append(at)
            self.texts.append(text)
        u = obj.get("usage")
        if isinstance(u, dict) and isinstance(u.get("completion_tokens"), int):
            self.usage = u["completion_tokens"]
        # TGI's stream: {"token": {"text"}}, its last event has generated_text.
        tok = obj.get("token")
        if text is None and isinstance(tok, dict) and isinstance(tok.get("text"), str):
            if tok["text"] and not tok.get("special"):
                self.token_at.append(at)
                self.texts.append(tok["text"])
            if obj.get("generated_text") is not None:
                self.done = True


class _Body:
    """A non-streamed answer's body, kept for its text (keep_text)."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def feed(self, data: bytes, at: float) -> None:
        self.parts.append(data)

    def text(self) -> str:
        try:
            obj = json.loads(b"".join(self.parts))
        except ValueError:
            return ""
        if isinstance(obj, list) and obj and isinstance(obj[0], dict):  # TGI: [{generated_text}]
            obj = obj[0]
        if not isinstance(obj, dict):
            return ""
        if isinstance(obj.get("generated_text"), str):
            return str(obj["generated_text"])
        return _choice_text(obj, stream=False) or ""


def answer_text(content_type: str, raw: bytes) -> str:
    """The generated text of a whole answer: Server-Sent Events (the
    chunks' texts joined) or JSON (OpenAI completion or chat, TGI)."""
    if content_type.split(";")[0].strip().lower() == "text/event-stream":
        p = _SSE()
        p.feed(raw + b"\n\n", 0.0)
        return "".join(p.texts)
    b = _Body()
    b.feed(raw, 0.0)
    return b.text()


def _choice_text(obj: dict[str, Any], *, stream: bool) -> str | None:
    """choices[0]'s text: `text` (completions), `delta.content` (a chat
    chunk) or `message.content` (a chat answer); None if it has none."""
    ch = obj.get("choices")
    if not isinstance(ch, list) or not ch or not isinstance(ch[0], dict):
        return None
    c = ch[0]
    part = c.get("delta" if stream else "message")
    if isinstance(part, dict) and isinstance(part.get("content"), str):
        return str(part["content"])
    t = c.get("text")
    return t if isinstance(t, str) else None


# ---- windows -------------------------------------------------------------------


@dataclass(frozen=True)
class WindowStats:
    """Requests due in [start, end). Percentiles (seconds) are over every
    request, errors included (the time each caller waited for an answer of
    any kind, as vegeta reports it; a timeout counts with its full wait), NaN
    for an empty window. error_rate: errors / count (NaN when empty).
    throughput: successful (2xx) answers per second of the window.

    Streamed answers (NaN without any): ttft_* over the requests whose
    first token came (a timeout before any token: its full wait, like the
    latency), itl_* over every gap between token chunks of the window's
    requests (vLLM's ITL), output_tokens_per_s the successful requests'
    output tokens per second of the window, goodput the share of requests
    that are good (`good`: no error and every per-request bound met, the
    DistServe / vLLM sense; NaN when no `good` was given)."""

    start: float
    end: float
    count: int
    p50: float
    p95: float
    p99: float
    error_rate: float
    throughput: float
    ttft_p50: float = math.nan
    ttft_p95: float = math.nan
    ttft_p99: float = math.nan
    itl_p50: float = math.nan
    itl_p95: float = math.nan
    itl_p99: float = math.nan
    output_tokens_per_s: float = math.nan
    goodput: float = math.nan


def _q(xs: Sequence[float], q: float) -> float:
    """Quantile of sorted xs, linear interpolation between closest ranks
    (numpy's default), so numbers compare with numpy/pandas output."""
    if not xs:
        return math.nan
    h = (len(xs) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


Good = Callable[[Sample], bool]


def window_stats(
    samples: Sequence[Sample], start: float, end: float, good: Good | None = None
) -> WindowStats:
    return _stats([s for s in samples if start <= s.due < end], start, end, good)


def _ttft(s: Sample) -> float:
    if not math.isnan(s.ttft):
        return s.ttft
    return s.latency if s.error == "timeout" else math.nan


def _stats(
    sel: Sequence[Sample], start: float, end: float, good: Good | None = None
) -> WindowStats:
    lat = sorted(s.latency for s in sel)
    n = len(sel)
    errs = sum(1 for s in sel if s.error)
    width = end - start
    streamed = any(s.tokens or not math.isnan(s.ttft) for s in sel)
    extra: dict[str, float] = {}
    if streamed:
        tt = sorted(x for x in map(_ttft, sel) if not math.isnan(x))
        gaps = sorted(g for s in sel for g in s.itl)
        toks = sum(s.tokens for s in sel if not s.error)
        extra = {
            "ttft_p50": _q(tt, 0.50),
            "ttft_p95": _q(tt, 0.95),
            "ttft_p99": _q(tt, 0.99),
            "itl_p50": _q(gaps, 0.50),
            "itl_p95": _q(gaps, 0.95),
            "itl_p99": _q(gaps, 0.99),
            "output_tokens_per_s": toks / width if width > 0 else math.nan,
        }
    if good is not None and n:
        extra["goodput"] = sum(1 for s in sel if not s.error and good(s)) / n
    return WindowStats(
        start=start,
        end=end,
        count=n,
        p50=_q(lat, 0.50),
        p95=_q(lat, 0.95),
        p99=_q(lat, 0.99),
        error_rate=errs / n if n else math.nan,
        throughput=(n - errs) / width if width > 0 else math.nan,
        **extra,
    )


def windows(
    samples: Sequence[Sample], start: float, end: float, width: float, good: Good | None = None
) -> list[WindowStats]:
    """Consecutive windows of `width` seconds from start; the last one ends
    at `end` (shorter if the span is not a multiple of width)."""
    if not width > 0:
        raise LoadError(f"window width {width!r} must be positive")
    srt = sorted(samples, key=lambda s: s.due)
    dues = [s.due for s in srt]
    out: list[WindowStats] = []
    k = 0
    while True:
        a = start + k * width  # multiples, not repeated sums: no drift
        if a >= end - 1e-9:
            break
        b = min(start + (k + 1) * width, end)
        out.append(_stats(srt[bisect_left(dues, a) : bisect_left(dues, b)], a, b, good))
        k += 1
    return out
