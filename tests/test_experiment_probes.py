"""pyctl.experiment.probes: tolerances, TOML tables, and each probe kind
against real local servers and real processes (no root)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from pyctl.experiment import probes as P
from pyctl.experiment.probes import Probe, ProbeError, Tolerance, probe_from_toml

W = "exp.toml:steady_state.probes.x"


# ---- tolerances ----------------------------------------------------------------


@pytest.mark.parametrize(
    "tol,good,bad",
    [
        (200, [200, 200.0, "200"], [201, "ok", None]),
        ("closed", ["closed"], ["open", None, ""]),
        (True, [True, "true", "True"], [False, "false", None]),
        (False, [False], [True]),
        ([200, 299], [200, 250, 299, "204"], [199, 300, "x"]),
        ("<= 0.2", [0.2, 0.1, "0.05", 0], [0.21, "nan", None]),
        ("> 5", [6, 5.01], [5, 4]),
        ("== closed", ["closed"], ["open"]),
        ("!= open", ["closed", "half-open"], ["open"]),
        ("== 3", [3, "3", 3.0], [4]),
        ("<= 200ms", [0.2, 0.15, "150ms"], [0.201, "1s"]),
        (["10ms", "1s"], [0.01, 0.5, 1], [0.009, 1.5]),
        ({"regex": "^clo"}, ["closed"], ["open", None]),
        ({"regex": "ok|degraded"}, ["status: degraded"], ["unhealthy"]),
    ],
)
def test_tolerance_forms(tol: object, good: list[object], bad: list[object]):
    t = Tolerance.from_toml(tol, W)
    for v in good:
        assert t.check(v), f"{tol!r} should accept {v!r}"
    for v in bad:
        assert not t.check(v), f"{tol!r} should refuse {v!r}"


def test_tolerance_str():
    assert str(Tolerance.from_toml(200, W)) == "== 200"
    assert str(Tolerance.from_toml("closed", W)) == "== closed"
    assert str(Tolerance.from_toml("<= 200ms", W)) == "<= 200ms"
    assert str(Tolerance.from_toml([1, 2], W)) == "in [1, 2]"
    assert str(Tolerance.from_toml({"regex": "a+"}, W)) == "matches /a+/"


@pytest.mark.parametrize(
    "bad,msg",
    [
        ([1, 2, 3], "a range is [lo, hi]"),
        ([5, 1], "lo > hi"),
        (["a", 1], "not a number or a duration"),
        ("< closed", "text compares only with == or !="),
        ("<=", "compares with nothing"),
        ({"regex": "("}, "not a regular expression"),
        ({"regx": "a"}, "{regex = "),
        ({"regex": 5}, "expected a string"),
        ([[1], 2], "not a number or a duration"),
    ],
)
def test_tolerance_errors_name_where(bad: object, msg: str):
    with pytest.raises(ProbeError) as e:
        Tolerance.from_toml(bad, W)
    assert str(e.value).startswith(W) and msg in str(e.value)
    assert "\n" not in str(e.value)


# ---- tables --------------------------------------------------------------------


@pytest.mark.parametrize(
    "table,msg",
    [
        ({"url": "http://x"}, "missing key 'kind'"),
        ({"kind": "htp", "url": "http://x"}, ".kind: 'htp' is not a probe kind: use one of http"),
        (
            {"kind": "http", "url": "http://x", "tolerence": 1},
            "unknown key 'tolerence': use one of",
        ),
        ({"kind": "http"}, "missing key 'url'"),
        ({"kind": "http", "url": 5}, ".url: expected a string, got 5"),
        ({"kind": "http", "url": "ftp://x"}, ".url: 'ftp://x' is not an http(s) URL"),
        (
            {"kind": "http", "url": "http://x", "mode": "always"},
            ".mode: 'always' is not one of sot",
        ),
        (
            {"kind": "http", "url": "http://x", "timeout": "soon"},
            ".timeout: 'soon' is not a duration",
        ),
        ({"kind": "http", "url": "http://x", "timeout": 0}, ".timeout: 0 is not a duration longer"),
        ({"kind": "http", "url": "http://x", "retries": True}, ".retries: expected an integer"),
        ({"kind": "http", "url": "http://x", "retries": -1}, ".retries: -1 must be 0 or more"),
        ({"kind": "http", "url": "http://x", "json_path": "a"}, "json_path needs a tolerance"),
        (
            {"kind": "http", "url": "http://x", "json_path": "a..b", "tolerance": 1},
            "not a JSON path",
        ),
        ({"kind": "http", "url": "http://x", "status": [1]}, ".status: a range is [lo, hi]"),
        ({"kind": "http", "url": "http://x", "headers": {"a": 1}}, ".headers.a: expected a string"),
        ({"kind": "prometheus", "url": "http://x"}, "missing key 'query'"),
        ({"kind": "prometheus", "url": "http://x", "query": "up"}, "missing key 'tolerance'"),
        (
            {"kind": "metric", "url": "http://x", "name": "m", "tolerance": 1, "aggregate": "avg"},
            ".aggregate: 'avg' is not one of only, sum",
        ),
        ({"kind": "command", "command": "gf-no-such-program-x"}, "is not an executable"),
        ({"kind": "command", "command": []}, "a list must hold strings"),
        ({"kind": "command", "command": "echo 'x"}, "fix the quoting"),
        ({"kind": "process"}, "give exactly one of pid, pidfile, name, target"),
        ({"kind": "process", "pid": 1, "name": "x"}, "give exactly one of"),
        ({"kind": "process", "pid": 1, "check": "restarts"}, ".check: restarts are counted by"),
        ({"kind": "process", "pid": 1, "check": "exit_status"}, "exit_status needs target = true"),
        ({"kind": "process", "pid": "1"}, ".pid: expected an integer"),
    ],
)
def test_bad_tables(table: dict[str, Any], msg: str):
    with pytest.raises(ProbeError) as e:
        probe_from_toml("x", table, W)
    s = str(e.value)
    assert s.startswith(W) and msg in s, s
    assert "\n" not in s


def test_ignore_keys_and_run_properties():
    p = probe_from_toml(
        "h",
        {
            "kind": "http",
            "url": "http://127.0.0.1:1/health",
            "guard": 3,
            "mode": "onchaos",
            "timeout": "250ms",
            "retries": 2,
            "interval": 0.5,
            "initial_delay": "1s",
        },
        W,
        ignore={"guard"},
    )
    assert isinstance(p, Probe)
    assert (p.name, p.mode, p.timeout, p.retries, p.interval, p.initial_delay) == (
        "h",
        "onchaos",
        0.25,
        2,
        0.5,
        1.0,
    )


def test_nvml_without_pynvml_is_a_clear_error():
    try:
        import pynvml  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("pynvml is importable here")
    with pytest.raises(ProbeError) as e:
        probe_from_toml("g", {"kind": "nvml", "check": "xids"}, W)
    assert str(e.value).startswith(W) and "pip install nvidia-ml-py" in str(e.value)


# ---- local servers -------------------------------------------------------------


class _Srv:
    """A real HTTP server on 127.0.0.1; `route(method, path, query, body)`
    returns (status, content type, body bytes)."""

    def __init__(
        self, route: Callable[[str, str, dict[str, list[str]], bytes], tuple[int, str, bytes]]
    ):
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _go(self) -> None:
                u = urlsplit(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                outer.requests.append((self.command, self.path, body, dict(self.headers)))
                st, ct, data = route(self.command, u.path, parse_qs(u.query), body)
                self.send_response(st)
                self.send_header("Content-Type", ct)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _go

        self.requests: list[tuple[str, str, bytes, dict[str, str]]] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.t = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.t.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.t.join()


@pytest.fixture
def health() -> Iterator[_Srv]:
    state = {
        "breaker": {"state": "closed", "trips": 0},
        "status": "ok",
        "choices": [{"text": "hi"}],
        "nested": {"a.b": 7},
    }

    def route(m: str, path: str, q: dict[str, list[str]], body: bytes) -> tuple[int, str, bytes]:
        if path == "/health":
            code = 503 if state["status"] == "unhealthy" else 200
            return code, "application/json", json.dumps(state).encode()
        if path == "/text":
            return 200, "text/plain", b"all good here\n"
        if path == "/slow":
            time.sleep(1.0)
            return 200, "text/plain", b"late"
        if path == "/echo":
            return 200, "application/json", body
        return 404, "text/plain", b"no"

    s = _Srv(route)
    s.state = state  # type: ignore[attr-defined]
    yield s
    s.close()


def _p(table: dict[str, Any]) -> Any:
    return probe_from_toml("t", table, W)


def test_http_json_path_breaker(health: _Srv):
    p = _p(
        {
            "kind": "http",
            "url": health.url + "/health",
            "json_path": "breaker.state",
            "tolerance": "closed",
        }
    )
    r = p.sample()
    assert r.ok and r.value == "closed" and "breaker.state = 'closed'" in r.detail
    assert abs(r.at - time.time()) < 5
    health.state["breaker"]["state"] = "open"  # type: ignore[attr-defined]
    r = p.sample()
    assert not r.ok and r.value == "open" and "not == closed" in r.detail


def test_http_paths_indexes_and_quoted_keys(health: _Srv):
    assert (
        _p(
            {
                "kind": "http",
                "url": health.url + "/health",
                "json_path": "$.choices[0].text",
                "tolerance": "hi",
            }
        )
        .sample()
        .ok
    )
    r = _p(
        {
            "kind": "http",
            "url": health.url + "/health",
            "json_path": 'nested["a.b"]',
            "tolerance": "> 5",
        }
    ).sample()
    assert r.ok and r.value == 7
    r = _p(
        {"kind": "http", "url": health.url + "/health", "json_path": "breaker.nope", "tolerance": 1}
    ).sample()
    assert not r.ok and r.value is None and "no breaker.nope in the answer" in r.detail
    r = _p({"kind": "http", "url": health.url + "/text", "json_path": "a", "tolerance": 1}).sample()
    assert not r.ok and "not JSON" in r.detail


def test_http_status_and_body(health: _Srv):
    r = _p({"kind": "http", "url": health.url + "/health"}).sample()
    assert r.ok and r.value == 200
    health.state["status"] = "unhealthy"  # type: ignore[attr-defined]
    r = _p({"kind": "http", "url": health.url + "/health"}).sample()
    assert not r.ok and r.value == 503 and "want in [200, 299]" in r.detail
    assert _p({"kind": "http", "url": health.url + "/health", "status": 503}).sample().ok
    r = _p({"kind": "http", "url": health.url + "/text", "tolerance": {"regex": "good"}}).sample()
    assert r.ok and r.value == "all good here\n"
    r = _p({"kind": "http", "url": health.url + "/nope"}).sample()
    assert not r.ok and r.value == 404


def test_http_post_body_and_headers(health: _Srv):
    r = _p(
        {
            "kind": "http",
            "url": health.url + "/echo",
            "method": "POST",
            "body": {"prompt": "x", "max_tokens": 2},
            "headers": {"X-Test": "1"},
            "json_path": "max_tokens",
            "tolerance": 2,
        }
    ).sample()
    assert r.ok
    m, _path, body, hdrs = health.requests[-1]
    assert m == "POST" and json.loads(body) == {"prompt": "x", "max_tokens": 2}
    assert hdrs["X-Test"] == "1" and hdrs["Content-Type"] == "application/json"


def test_http_timeout_and_refused(health: _Srv):
    t0 = time.monotonic()
    r = _p({"kind": "http", "url": health.url + "/slow", "timeout": "200ms"}).sample()
    assert not r.ok and "timeout" in r.detail and time.monotonic() - t0 < 0.9
    # a port nothing listens on: bind one, close it
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = _p({"kind": "http", "url": f"http://127.0.0.1:{port}/health"}).sample()
    assert not r.ok and r.value is None and "connection refused" in r.detail


def test_retries_until_ok(health: _Srv):
    calls = {"n": 0}

    def route(m: str, path: str, q: Any, body: bytes) -> tuple[int, str, bytes]:
        calls["n"] += 1
        return (200 if calls["n"] >= 3 else 500), "text/plain", b"x"

    s = _Srv(route)
    try:
        r = _p({"kind": "http", "url": s.url, "retries": 3, "interval": "10ms"}).sample()
        assert r.ok and calls["n"] == 3
        calls["n"] = -10
        r = _p({"kind": "http", "url": s.url, "retries": 1, "interval": 0}).sample()
        assert not r.ok and "(2 attempts)" in r.detail and calls["n"] == -8
    finally:
        s.close()


# -- prometheus: a STAND-IN for Prometheus, not Prometheus. It answers
# /api/v1/query in the documented JSON format (prometheus.io/docs/prometheus/
# latest/querying/api/#instant-queries); a test against a real Prometheus is
# another issue's.
@pytest.fixture
def prom_standin() -> Iterator[_Srv]:
    answers: dict[str, tuple[int, dict[str, Any]]] = {
        "up": (
            200,
            {
                "status": "success",
                "data": {
                    "resultType": "vector",
                    "result": [
                        {"metric": {"__name__": "up", "job": "svc"}, "value": [1796110659.1, "1"]}
                    ],
                },
            },
        ),
        "scalar(0.15)": (
            200,
            {
                "status": "success",
                "data": {"resultType": "scalar", "result": [1796110659.1, "0.15"]},
            },
        ),
        "two": (
            200,
            {
                "status": "success",
                "data": {
                    "resultType": "vector",
                    "result": [
                        {"metric": {"i": "1"}, "value": [1, "1"]},
                        {"metric": {"i": "2"}, "value": [1, "2"]},
                    ],
                },
            },
        ),
        "none": (200, {"status": "success", "data": {"resultType": "vector", "result": []}}),
        "range[1m]": (200, {"status": "success", "data": {"resultType": "matrix", "result": []}}),
        "bad(": (
            400,
            {
                "status": "error",
                "errorType": "bad_data",
                "error": "1:5: parse error: unclosed left parenthesis",
            },
        ),
    }

    def route(m: str, path: str, q: dict[str, list[str]], body: bytes) -> tuple[int, str, bytes]:
        if path != "/api/v1/query":
            return 404, "text/plain", b"404 page not found\n"
        st, doc = answers[q["query"][0]]
        return st, "application/json", json.dumps(doc).encode()

    s = _Srv(route)
    yield s
    s.close()


def test_prometheus_standin(prom_standin: _Srv):
    def pr(query: str, tol: object) -> Any:
        return _p(
            {"kind": "prometheus", "url": prom_standin.url, "query": query, "tolerance": tol}
        ).sample()

    r = pr("up", 1)
    assert r.ok and r.value == 1.0
    assert prom_standin.requests[-1][1].startswith("/api/v1/query?query=up")
    r = pr("scalar(0.15)", "<= 0.2")
    assert r.ok and r.value == 0.15
    assert not pr("scalar(0.15)", "< 0.1").ok
    r = pr("two", 1)
    assert not r.ok and "returned 2 series, want 1" in r.detail
    r = pr("none", 1)
    assert not r.ok and "returned 0 series" in r.detail
    assert "matrix" in pr("range[1m]", 1).detail
    r = pr("bad(", 1)
    assert not r.ok and "bad_data: 1:5: parse error" in r.detail


# -- metric: a real prometheus_client exposition, like the service's /metrics
@pytest.fixture
def metrics_srv() -> Iterator[_Srv]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    g = Gauge("gf_service_breaker_state", "0 closed, 1 half-open, 2 open", registry=reg)
    c = Counter("gf_service_errors", "errors", ["kind", "code"], registry=reg)
    h = Histogram("gf_service_request_duration_seconds", "lat", ["outcome"], registry=reg)
    g.set(2)
    c.labels("device", "CUDA_ERROR_OUT_OF_MEMORY").inc(3)
    c.labels("shed", "queue_full").inc(2)
    c.labels("timeout", "").inc(0)
    h.labels("ok").observe(0.03)

    s = _Srv(lambda m, p, q, b: (200, "text/plain; version=0.0.4", generate_latest(reg)))
    yield s
    s.close()


def test_metric_probe(metrics_srv: _Srv):
    url = metrics_srv.url + "/metrics"

    def mp(**kw: Any) -> Any:
        return _p({"kind": "metric", "url": url, **kw}).sample()

    r = mp(name="gf_service_breaker_state", tolerance=2)
    assert r.ok and r.value == 2.0 and "gf_service_breaker_state = 2" in r.detail
    r = mp(name="gf_service_errors_total", labels={"kind": "device"}, tolerance=">= 3")
    assert r.ok and r.value == 3.0
    r = mp(name="gf_service_errors_total", tolerance="== 0")
    assert not r.ok and "3 samples match" in r.detail
    r = mp(name="gf_service_errors_total", aggregate="sum", tolerance=5)
    assert r.ok and r.value == 5.0
    r = mp(name="gf_service_request_duration_seconds_count", labels={"outcome": "ok"}, tolerance=1)
    assert r.ok
    r = mp(name="gf_service_nope", tolerance=1)
    assert not r.ok and "no sample gf_service_nope" in r.detail and "names there" in r.detail


# ---- command -------------------------------------------------------------------


def test_command_exit_status_and_stdout(tmp_path: Path):
    assert _p({"kind": "command", "command": "true"}).sample().ok
    r = _p({"kind": "command", "command": ["sh", "-c", "echo oops >&2; exit 3"]}).sample()
    assert not r.ok and r.value == 3 and "want == 0" in r.detail and "oops" in r.detail
    assert _p({"kind": "command", "command": "sh -c 'exit 3'", "exit_status": 3}).sample().ok
    r = _p({"kind": "command", "command": "echo 0.15", "tolerance": "<= 0.2"}).sample()
    assert r.ok and r.value == "0.15"
    r = _p(
        {
            "kind": "command",
            "command": "echo $GF_X; pwd",
            "shell": True,
            "env": {"GF_X": "hello"},
            "cwd": str(tmp_path),
            "tolerance": {"regex": "hello"},
        }
    ).sample()
    assert r.ok and str(tmp_path) in str(r.value)


def test_command_timeout_kills_the_group(tmp_path: Path):
    marker = tmp_path / "child.pid"
    t0 = time.monotonic()
    r = _p(
        {
            "kind": "command",
            "shell": True,
            "timeout": "300ms",
            "command": f"sleep 30 & echo $! > {marker}; wait",
        }
    ).sample()
    assert not r.ok and "timeout after 0.3s (killed)" in r.detail
    assert time.monotonic() - t0 < 5
    child = int(marker.read_text())
    # The shell's child got the group's SIGKILL. It closed the stdout pipe
    # (the probe read it to EOF) early in its exit, before it became a
    # zombie, so await the exit itself: its pidfd turns readable then. A
    # child the kill missed would run its 30 s.
    try:
        fd = os.pidfd_open(child)
    except ProcessLookupError:
        return  # already exited and reaped
    try:
        assert select.select([fd], [], [], 5)[0], P._stat(child)
    finally:
        os.close(fd)


# ---- process -------------------------------------------------------------------


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    ps: list[subprocess.Popen[bytes]] = []
    yield ps
    for p in ps:
        p.kill()
        p.wait()


def _sleeper(procs: list[subprocess.Popen[bytes]], exe: str = "sleep") -> subprocess.Popen[bytes]:
    p = subprocess.Popen([exe, "60"])
    procs.append(p)
    return p


def test_process_pid_alive_and_dead(procs: list[subprocess.Popen[bytes]]):
    p = _sleeper(procs)
    probe = _p({"kind": "process", "pid": p.pid})
    r = probe.sample()
    assert r.ok and r.value is True and f"pid {p.pid} alive" in r.detail
    p.kill()
    p.wait()
    r = probe.sample()
    assert not r.ok and r.value is False and "not running" in r.detail
    # expecting it dead
    assert _p({"kind": "process", "pid": p.pid, "tolerance": False}).sample().ok


def test_process_zombie_is_dead(procs: list[subprocess.Popen[bytes]]):
    p = _sleeper(procs)
    probe = _p({"kind": "process", "pid": p.pid})
    p.kill()
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert P._stat(p.pid)[0] == "Z"  # type: ignore[index]
    assert not probe.sample().ok


def test_process_target_exit_status(procs: list[subprocess.Popen[bytes]]):
    probe = _p({"kind": "process", "target": True, "check": "exit_status", "tolerance": 7})
    assert "not bound" in probe.sample().detail
    p = subprocess.Popen(["sh", "-c", "read x; exit 7"], stdin=subprocess.PIPE)
    procs.append(p)
    probe.bind(p.pid, p)
    r = probe.sample()
    assert not r.ok and "still running" in r.detail
    p.communicate(b"go\n")
    r = probe.sample()
    assert r.ok and r.value == 7
    alive = _p({"kind": "process", "target": True})
    alive.bind(p.pid, p)
    assert not alive.sample().ok


def test_process_pidfile_restarts(tmp_path: Path, procs: list[subprocess.Popen[bytes]]):
    pidfile = tmp_path / "svc.pid"
    probe = _p({"kind": "process", "pidfile": str(pidfile), "check": "restarts"})
    alive = _p({"kind": "process", "pidfile": str(pidfile)})
    r = probe.sample()
    assert r.ok and r.value == 0 and "none running" in r.detail
    assert not alive.sample().ok
    a = _sleeper(procs)
    pidfile.write_text(f"{a.pid}\n")
    assert probe.sample().value == 0 and alive.sample().ok
    a.kill()
    a.wait()
    assert probe.sample().value == 0  # dead, stale pidfile: not a restart yet
    assert not alive.sample().ok
    b = _sleeper(procs)
    pidfile.write_text(f"{b.pid}\n")
    r = probe.sample()
    assert not r.ok and r.value == 1 and f"1 restarts, pid {b.pid} running" in r.detail
    assert (
        _p({"kind": "process", "pidfile": str(pidfile), "check": "restarts", "tolerance": "<= 1"})
        .sample()
        .ok
    )


def test_process_name_restarts(tmp_path: Path, procs: list[subprocess.Popen[bytes]]):
    exe = tmp_path / "gfprobe-sleep"  # comm is the file name: unique to this test
    shutil.copy(shutil.which("sleep") or "/bin/sleep", exe)
    probe = _p({"kind": "process", "name": exe.name, "check": "restarts"})
    alive = _p({"kind": "process", "name": exe.name})
    assert not alive.sample().ok
    a = _sleeper(procs, str(exe))
    deadline = time.monotonic() + 10
    while not alive.sample().ok:  # until the exec has set its comm
        assert time.monotonic() < deadline
    assert probe.sample().value == 0
    a.kill()
    a.wait()
    b = _sleeper(procs, str(exe))
    while True:
        r = probe.sample()
        if r.value == 1:
            break
        assert time.monotonic() < deadline + 10
    assert f"pid {b.pid}" in r.detail


# ---- nvml: a STAND-IN pynvml module (no GPU, no NVML here); the counting
# logic only. The real NVML is exercised on the GPU host.
def test_nvml_probe_with_a_standin_pynvml(monkeypatch: pytest.MonkeyPatch):
    events = [13, 79]

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            self.value = value

    class Mem:
        used = 123 << 20

    def wait(es: object, ms: int) -> Any:
        if not events:
            raise NVMLError(10)
        return types.SimpleNamespace(eventType=8, eventData=events.pop(0))

    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_ERROR_TIMEOUT=10,
        nvmlEventTypeXidCriticalError=8,
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: ("h", i),
        nvmlDeviceGetMemoryInfo=lambda h: Mem,
        nvmlEventSetCreate=lambda: "set",
        nvmlDeviceRegisterEvents=lambda h, t, s: None,
        nvmlEventSetWait_v2=wait,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    r = _p({"kind": "nvml", "check": "memory_used", "tolerance": "<= 200000000"}).sample()
    assert r.ok and r.value == 123 << 20
    xp = _p({"kind": "nvml", "check": "xids"})
    r = xp.sample()
    assert not r.ok and r.value == 2 and "2 Xids (13, 79)" in r.detail
    with pytest.raises(ProbeError, match=r"\.device: 3 is not a GPU here"):
        _p({"kind": "nvml", "device": 3, "tolerance": 1})


# ---- parsed once: at load; the run fills in the target's facts ---------------------------

ONCE = """
name = "once"
version = 1
title = "t"
[target]
url = "http://127.0.0.1:1"
pid = 1
[steady_state.probes.health]
kind = "http"
mode = "continuous"
url = "{url}/health"
headers = { X-Port = "port {port}" }
json_path = "out"
tolerance = { same_as = "first" }
[probes.me]
kind = "process"
mode = "continuous"
pid = "{pid}"
[probes.cmd]
kind = "command"
mode = "continuous"
command = ["kill", "-0", "{pid}"]
"""


def test_a_probe_is_parsed_once_at_load_and_the_run_fills_in_facts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyctl.experiment import load as F
    from pyctl.experiment import probe_state as S
    from pyctl.experiment.probes import base

    path = tmp_path / "once.toml"
    path.write_text(ONCE)
    exp = F.load(str(path))
    health = exp.probes["health"]
    assert isinstance(health, P.HttpProbe) and health.url == "{url}/health"

    def no_parse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("a probe table was parsed again at run time")

    monkeypatch.setattr(base._Table, "__init__", no_parse)
    me = os.getpid()
    facts = {"url": "http://127.0.0.1:9", "host": "127.0.0.1", "port": 9, "pid": me}
    states = S.build_probes(exp, facts)
    got = states["health"].probe
    assert (got.url, got.headers) == ("http://127.0.0.1:9/health", {"X-Port": "port 9"})
    assert states["me"].probe.pid == me and states["me"].probe.sample().ok
    assert states["cmd"].probe.argv == ["kill", "-0", str(me)]
    assert states["cmd"].probe.sample().ok
    # The loaded probe is untouched, and each run's tolerance starts fresh:
    # same_as's reference of one run is not the next run's.
    assert health.url == "{url}/health" and health.tolerance is not None
    assert got.tolerance is not None and got.tolerance.check("a")
    again = S.build_probes(exp, facts)["health"].probe
    assert again.tolerance is not None and again.tolerance.check("b")
    assert not got.tolerance.check("b")


def test_a_fact_in_a_probe_is_checked_with_a_stand_in_at_load(tmp_path: Path) -> None:
    from pyctl.experiment import load as F
    from pyctl.experiment import model as M

    path = tmp_path / "once.toml"
    path.write_text(ONCE.replace('url = "{url}/health"', 'url = "{url}:x/health"'))
    with pytest.raises(M.ExperimentError, match=r"steady_state\.probes\.health\.url: .*bad port"):
        F.load(str(path))
