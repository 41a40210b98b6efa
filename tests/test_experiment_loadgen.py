"""pyctl.experiment.loadgen: the open-loop load generator against a real
local HTTP server of known delay (tests/delay_server.py)."""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
from delay_server import DelayServer

from pyctl.experiment.arrival import Arrival
from pyctl.experiment.loadgen import LoadError, OpenLoopLoad, Sample, window_stats, windows


def _run(load: OpenLoopLoad) -> list[Sample]:
    """Start, let the scheduler emit its `duration` of requests, stop."""
    load.start()
    assert load.wait(60)
    load.stop()
    return load.samples()


def test_fixed_rate_absolute_schedule_and_counts():
    with DelayServer(0.005) as srv:
        load = OpenLoopLoad(srv.url, 100, duration=1.0, concurrency=8)
        s = _run(load)
        c = load.counts()
        conns = srv.httpd.connections
    assert len(s) == 100
    # due times are t0 + i/rate exactly: no drift, whatever the wake-ups did
    for i, x in enumerate(s):
        assert x.due - s[0].due == pytest.approx(i / 100, abs=1e-6)
    assert (c["scheduled"], c["sent"], c["answered"], c["ok"], c["errors"]) == (
        100,
        100,
        100,
        100,
        {},
    )
    assert c["in_flight"] == 0 and c["backlog"] == 0
    assert c["sched_lag_ms"]["p99"] is not None and c["sched_lag_ms"]["max"] >= 0
    assert conns <= 8  # keep-alive: at most one connection per worker


def test_latency_is_measured_from_due_and_bounded_by_the_truth():
    with DelayServer(0.02) as srv:
        s = _run(OpenLoopLoad(srv.url, 50, duration=1.0, concurrency=8))
        truth = sorted(t for _, t in srv.log)
    lat = sorted(x.latency for x in s)
    assert all(x.status == 200 and x.error == "" and x.ok for x in s)
    assert all(x.latency == pytest.approx(x.done - x.due, abs=1e-6) for x in s)
    assert all(x.due <= x.sent < x.done for x in s)
    # never below what the server took; the server shares this GIL, so only
    # a loose upper bound here (bench/bench_loadgen.py measures accuracy)
    assert lat[0] >= truth[0] - 1e-4
    assert window_stats(s, s[0].due, s[-1].due + 1).p50 < truth[len(truth) // 2] + 0.015


def test_no_coordinated_omission_when_the_server_stalls():
    """Two connections, a server that holds every answer: requests keep
    falling due at the rate although none can be sent, and each one's
    latency runs from its due time to the release, not from when a
    connection came free."""
    srv = DelayServer(0.0)
    srv.gate = threading.Event()
    srv.start()
    try:
        load = OpenLoopLoad(srv.url, 100, duration=0.5, concurrency=2, timeout=30)
        load.start()
        assert load.wait(60)  # 50 requests have fallen due while 2 are stuck
        c = load.counts()
        released = time.time()
        srv.gate.set()
        load.stop()
        s = load.samples()
    finally:
        srv.close()
    assert c["sent"] == 2 and c["backlog"] + c["sent"] == 50
    assert len(s) == 50 and all(x.ok for x in s)
    for x in s:
        assert x.done >= released
        assert x.latency >= released - x.due - 1e-6
    # the first request waited the whole stall, ~0.5 s
    assert s[0].latency >= 0.45
    # the queued ones were sent late: the lag shows it (a closed-loop client
    # would have timed them from `sent` and hidden the stall)
    assert all(x.lag >= released - x.due - 1e-6 for x in s[2:])
    assert sum(x.done - x.sent for x in s[2:]) < sum(x.latency for x in s[2:])


def test_timeouts_from_due_time_and_expired_backlog():
    with DelayServer(2.0) as srv:
        load = OpenLoopLoad(srv.url, 20, duration=0.5, concurrency=1, timeout=0.2)
        s = _run(load)
        srv.gate = threading.Event()  # let close() not wait on sleeping handlers
    assert len(s) == 10 and all(x.error == "timeout" and x.status == 0 for x in s)
    for x in s:
        assert 0.2 - 1e-3 <= x.latency < 1.0
    # one connection, each request busy until its deadline: the next one
    # waited for it, and that wait is in its latency, not added on top
    assert all(x.lag > 0.1 for x in s[1:])
    assert load.counts()["errors"] == {"timeout": 10}


def test_http_errors_and_connection_errors():
    with DelayServer(0.0, status=503) as srv:
        load = OpenLoopLoad(srv.url, 50, duration=0.2)
        s = _run(load)
    assert s and all(x.status == 503 and x.error == "http-503" for x in s)
    assert load.counts()["answered"] == len(s) and load.counts()["ok"] == 0
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    load = OpenLoopLoad(f"http://127.0.0.1:{port}", 50, duration=0.2)
    s = _run(load)
    assert s and all(x.status == 0 and x.error == "conn" for x in s)
    assert load.counts()["answered"] == 0


def test_stop_sends_the_backlog_already_due():
    """Requests due before stop() but still queued are sent, not dropped."""
    srv = DelayServer(0.0)
    srv.gate = threading.Event()
    srv.start()
    try:
        load = OpenLoopLoad(srv.url, 100, duration=0.3, concurrency=1, timeout=30)
        load.start()
        assert load.wait(60)
        backlog = load.counts()["backlog"]
        srv.gate.set()
        load.stop()
        s = load.samples()
    finally:
        srv.close()
    assert backlog >= 28  # one is stuck in the server, the rest queued
    assert len(s) == 30 and all(x.ok and x.sent for x in s)


def test_request_body_path_and_url_forms():
    with DelayServer(0.0) as srv:
        OpenLoopLoad(srv.url + "/v1/completions", 10)  # full endpoint URL is accepted
        load = OpenLoopLoad(
            srv.url, 20, duration=0.1, path="/v1/completions", prompt="p", max_tokens=2
        )
        _run(load)
        assert load._path == "/v1/completions" and b'"max_tokens": 2' in load._body
        g = OpenLoopLoad(srv.url + "/health", 20, duration=0.1, method="GET")
        assert g._path == "/health" and g._body is None
        assert all(x.ok for x in _run(g))


@pytest.mark.parametrize(
    "args,kw,msg",
    [
        (("http://x", 0), {}, "rate"),
        (("http://x", math.inf), {}, "rate"),
        (("ftp://x", 1), {}, "not an http"),
        (("http://x", 1), {"concurrency": 0}, "concurrency"),
        (("http://x", 1), {"timeout": 0}, "timeout"),
        (("http://x:99999", 1), {}, "Port"),
    ],
)
def test_bad_arguments(args: tuple[str, float], kw: dict[str, object], msg: str):
    with pytest.raises(LoadError, match=msg):
        OpenLoopLoad(*args, **kw)  # type: ignore[arg-type]


# ---- windows -------------------------------------------------------------------


def _s(due: float, lat: float, err: str = "") -> Sample:
    return Sample(due, due + lat, lat, 0 if err else 200, err)


def test_window_stats_percentiles_match_numpy():
    np = pytest.importorskip("numpy")
    lats = [0.001 * ((i * 37) % 101) for i in range(1000)]
    s = [_s(i * 0.01, x) for i, x in enumerate(lats)]
    w = window_stats(s, 0, 10)
    assert w.count == 1000
    for q, v in ((50, w.p50), (95, w.p95), (99, w.p99)):
        assert v == pytest.approx(float(np.percentile(lats, q)), abs=1e-12)


def test_window_stats_errors_throughput_and_empty():
    s = [_s(0.1 * i, 0.01, "http-503" if i % 4 == 0 else "") for i in range(20)]  # 2 s
    w = window_stats(s, 0.0, 2.0)
    assert (
        w.count == 20 and w.error_rate == pytest.approx(0.25) and w.throughput == pytest.approx(7.5)
    )
    e = window_stats(s, 5.0, 6.0)
    assert e.count == 0 and math.isnan(e.p99) and math.isnan(e.error_rate) and e.throughput == 0


def test_windows_cover_the_span():
    s = [_s(0.1 * i, 0.001 * i) for i in range(35)]  # due 0.0 .. 3.4
    ws = windows(s, 0.0, 3.5, 1.0)
    assert [(w.start, w.end, w.count) for w in ws] == [
        (0.0, 1.0, 10),
        (1.0, 2.0, 10),
        (2.0, 3.0, 10),
        (3.0, 3.5, 5),
    ]
    assert ws[1].p50 == pytest.approx(0.0145)
    assert sum(w.count for w in windows(s, 0.0, 3.5, 0.3)) == 35
    with pytest.raises(LoadError):
        windows(s, 0, 1, 0)


# ---- the HTTP client: answer shapes --------------------------------------------


class _RawServer:
    """A socket server that answers every request with `answer` bytes, then
    closes the connection if `close_after` (without saying so: a keep-alive
    connection gone stale)."""

    def __init__(self, answer: bytes, close_after: bool = False) -> None:
        self.answer, self.close_after = answer, close_after
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.t = threading.Thread(target=self._serve, daemon=True)
        self.t.start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._conn, args=(c,), daemon=True).start()

    def _conn(self, c: socket.socket) -> None:
        buf = b""
        with c:
            while True:
                while b"\r\n\r\n" not in buf:
                    d = c.recv(65536)
                    if not d:
                        return
                    buf += d
                head, _, buf = buf.partition(b"\r\n\r\n")
                n = 0
                for ln in head.split(b"\r\n"):
                    if ln.lower().startswith(b"content-length:"):
                        n = int(ln.split(b":")[1])
                while len(buf) < n:
                    buf += c.recv(65536)
                buf = buf[n:]
                for i in range(0, len(self.answer), 7):  # in pieces: the parser must wait
                    c.sendall(self.answer[i : i + 7])
                if self.close_after:
                    return

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    "answer,conns",
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", 1),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\nhello\r\n3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n",
            1,
        ),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok", 1),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", 5),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", 5),
    ],
)
def test_answer_shapes_keep_alive_or_not(answer: bytes, conns: int):
    srv = _RawServer(answer, close_after=conns > 1)
    try:
        load = OpenLoopLoad(srv.url, 50, duration=0.1, concurrency=1)
        s = _run(load)
    finally:
        srv.close()
    assert len(s) == 5 and all(x.ok for x in s), [x.error for x in s]
    assert srv.accepted == conns


def test_body_to_end_of_connection():
    srv = _RawServer(b"HTTP/1.1 200 OK\r\n\r\nuntil close", close_after=True)
    try:
        s = _run(OpenLoopLoad(srv.url, 50, duration=0.1, concurrency=1))
    finally:
        srv.close()
    assert len(s) == 5 and all(x.ok for x in s) and srv.accepted == 5


def test_stale_keep_alive_connection_is_retried_once():
    # The server closes each connection after one answer without a
    # Connection: close header; the next request finds it stale.
    srv = _RawServer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", close_after=True)
    try:
        load = OpenLoopLoad(srv.url, 20, duration=0.25, concurrency=1)
        s = _run(load)
    finally:
        srv.close()
    assert len(s) == 5 and all(x.ok for x in s), [x.error for x in s]
    assert load.counts()["sent"] == 5 and srv.accepted == 5


def test_garbage_answer_is_a_conn_error():
    srv = _RawServer(b"SSH-2.0-OpenSSH\r\n\r\n")
    try:
        s = _run(OpenLoopLoad(srv.url, 50, duration=0.1, concurrency=1))
    finally:
        srv.close()
    assert s and all(x.error == "conn" and x.status == 0 for x in s)


def test_arrival_is_the_kernels_stamp():
    """The answer's time comes from SO_TIMESTAMPNS: never after the moment
    the thread read it, never before the request was sent."""
    from pyctl.experiment import loadgen as L

    with DelayServer(0.01) as srv:
        c = L._Conn("127.0.0.1", srv.port, 5.0, False)
        try:
            assert c.kernel_ts
            req = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n\r\n".encode()
            for _ in range(5):
                t0 = time.monotonic()
                status, close, at = c.exchange(req, t0 + 5)
                t1 = time.monotonic()
                assert status == 200 and not close and t0 + 0.009 < at <= t1
        finally:
            c.close()


def _sched_thread_policy(load: OpenLoopLoad) -> int:
    """The scheduler thread's policy, read from the kernel while it runs."""
    t = load._sched
    assert t is not None and t.native_id is not None
    return _policy(t.native_id)


def _policy(tid: int) -> int:
    """A thread's policy; SCHED_FIFO threads carry SCHED_RESET_ON_FORK."""
    p = os.sched_getscheduler(tid)
    assert p == os.SCHED_OTHER or p & os.SCHED_RESET_ON_FORK, p
    return p & ~os.SCHED_RESET_ON_FORK


@pytest.mark.root
def test_the_load_threads_are_real_time_and_nothing_else_is():
    """As root the scheduler and the workers run SCHED_FIFO (a normal
    thread wakes up milliseconds late on a busy host: docs/benchmarks.md
    "Arrivals"); the caller's thread is never changed."""
    with DelayServer(0.002) as srv:
        load = OpenLoopLoad(srv.url, 50, duration=1.0, concurrency=4)
        load.start()
        # the threads set their policy first thing: wait for the first
        # answer rather than for a time
        deadline = time.monotonic() + 10
        while load.counts()["answered"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        policy = _sched_thread_policy(load)
        workers = {_policy(t.native_id or 0) for t in load._threads}
        assert load.wait(30)
        load.stop()
    assert policy == os.SCHED_FIFO and workers == {os.SCHED_FIFO}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    assert load.counts()["sched_policy"] == "fifo"


@pytest.mark.root
def test_a_closed_loop_stays_normal():
    """A closed loop has no schedule to keep: its clients stay normal."""
    with DelayServer(0.002) as srv:
        load = OpenLoopLoad(srv.url, 1, arrival=Arrival("closed", clients=2), duration=0.5)
        load.start()
        deadline = time.monotonic() + 10
        while load.counts()["answered"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        workers = {_policy(t.native_id or 0) for t in load._threads}
        assert load.wait(30)
        load.stop()
    assert workers == {os.SCHED_OTHER}


@pytest.mark.parametrize(
    "kw, why",
    [({"realtime": False}, "other (realtime = false)"), ({"rate": 800.0}, "above the 500/s")],
)
def test_the_scheduler_stays_normal_when_told_or_too_fast(kw: dict[str, object], why: str):
    rate = float(kw.pop("rate", 50.0))  # type: ignore[arg-type]
    with DelayServer(0.001) as srv:
        load = OpenLoopLoad(srv.url, rate, duration=0.05, concurrency=4, **kw)  # type: ignore[arg-type]
        _run(load)
    assert why in load.counts()["sched_policy"]


@pytest.mark.root
def test_without_cap_sys_nice_the_scheduler_says_why(tmp_path):
    """Root without CAP_SYS_NICE (a container's usual bounding set; the GPU
    host's root has not got it) gets a normal thread with a 0.1 ms EEVDF
    slice, read back from the kernel, and the reason; the load runs all
    the same."""
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
        "from delay_server import DelayServer\n"
        "from pyctl.experiment.loadgen import OpenLoopLoad\n"
        "with DelayServer(0.001) as srv:\n"
        "    load = OpenLoopLoad(srv.url, 50, duration=0.2, concurrency=2)\n"
        "    load.start(); load.wait(30); load.stop()\n"
        "    c = load.counts()\n"
        "print(c['sched_policy'], c['ok'])\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop CAP_SYS_NICE")
    out = subprocess.run(
        ["setpriv", "--bounding-set=-sys_nice", sys.executable, "-I", "-c", code]
        + [os.path.dirname(here), here],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=True,
    ).stdout.split()
    said = " ".join(out[:-1])
    assert said == "other, 0.1 ms slice (SCHED_FIFO: Operation not permitted)", said
    assert int(out[-1]) >= 9


def test_a_short_slice_is_read_back_from_the_kernel():
    """threadsched.short_slice sets a SCHED_OTHER thread's EEVDF slice and
    counts it only when sched_getattr gives it back (this 6.18 kernel does;
    one before 6.12 would take the call and ignore the slice)."""
    from pyctl import threadsched

    got: list[object] = []

    def thread() -> None:
        got.append(threadsched.short_slice(250_000))
        got.append(os.sched_getscheduler(0))
        got.append(_slice_of_this_thread())

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert got == [None, os.SCHED_OTHER, 250_000]
    assert _slice_of_this_thread() != 250_000  # the caller's thread untouched


def _slice_of_this_thread(tid: int = 0) -> int:
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(56)
    assert libc.syscall(315, tid, buf, 56, 0) == 0, os.strerror(ctypes.get_errno())
    return struct.unpack("=IIQiIQQQII", buf.raw)[5]


def test_realtime_slice_gives_every_load_thread_the_short_slice_only():
    """realtime = "slice": no real-time policy, the 0.1 ms slice on the
    scheduler and the workers (what a user without CAP_SYS_NICE gets)."""
    with DelayServer(0.002) as srv:
        load = OpenLoopLoad(srv.url, 50, duration=1.0, concurrency=3, realtime="slice")
        load.start()
        deadline = time.monotonic() + 10
        while load.counts()["answered"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        threads = [load._sched, *load._threads]
        got = {(os.sched_getscheduler(t.native_id), _slice_of_this_thread(t.native_id))
               for t in threads if t is not None and t.native_id is not None}  # fmt: skip
        assert load.wait(30)
        load.stop()
    assert got == {(os.SCHED_OTHER, 100_000)}
    assert load.counts()["sched_policy"] == "other, 0.1 ms slice (realtime = slice)"
    with pytest.raises(LoadError, match='give true, false or "slice"'):
        OpenLoopLoad("http://127.0.0.1:9", 5, realtime="fifo")


@pytest.mark.root
def test_a_process_forked_by_a_real_time_load_thread_starts_normal():
    """SCHED_RESET_ON_FORK: nothing a load thread starts inherits its priority."""
    from pyctl import threadsched

    got: list[object] = []

    def thread() -> None:
        got.append(threadsched.fifo())
        out = subprocess.run(
            [sys.executable, "-I", "-c", "import os; print(os.sched_getscheduler(0))"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        got.append(int(out))

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert got == [None, os.SCHED_OTHER]
