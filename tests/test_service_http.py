"""The reference service as a client sees it: a real process, real HTTP.

Every service is started on port 0 and waited for through its ready line
(tests/service_proc.py); bursts are released together by a barrier.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from service_proc import ServiceProc, sample

from pyctl import paths

needs_double = pytest.mark.skipif(
    not paths.DOUBLE_LIBCUDA.exists(), reason="run `make build` (the libcuda test double)"
)


@pytest.fixture(scope="module")
def svc():
    s = ServiceProc("--max-batch", "8", "--batch-wait", "150ms", "--max-tokens-limit", "32")
    yield s
    assert s.close() == 0, s.stderr()


def burst(n: int, fn) -> list:
    """n calls of fn(i) released at once."""
    gate = threading.Barrier(n)

    def one(i: int):
        gate.wait(30)
        return fn(i)

    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(one, range(n)))


def test_completion_is_openai_shaped(svc: ServiceProc) -> None:
    st, body = svc.complete("The quick brown fox", 5)
    assert st == 200, body
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["degraded"] is False and body["model"] == "gf-tiny-2l"
    assert isinstance(body["choices"][0]["text"], str)
    assert body["choices"][0]["finish_reason"] == "length"
    u = body["usage"]
    assert u["completion_tokens"] == 5 and u["prompt_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + 5
    # Same seed, greedy: the same prompt gives the same text.
    assert svc.complete("The quick brown fox", 5)[1]["choices"] == body["choices"]


def test_concurrent_requests_are_batched(svc: ServiceProc) -> None:
    before = svc.metric_samples()
    res = burst(6, lambda i: svc.complete(f"prompt number {i}", 3))
    assert all(st == 200 for st, _ in res), res
    after = svc.metric_samples()
    n = sample(after, "gf_service_batch_size_count") - sample(before, "gf_service_batch_size_count")
    total = sample(after, "gf_service_batch_size_sum") - sample(before, "gf_service_batch_size_sum")
    assert total == 6 and n < 6, f"6 requests ran in {n} batches"
    singles = sample(after, "gf_service_batch_size_bucket", le="1.0") - sample(
        before, "gf_service_batch_size_bucket", le="1.0"
    )
    assert singles < n or n == 1  # at least one batch had more than one request


@pytest.mark.parametrize(
    "body, needle",
    [
        (b"{not json", "invalid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"max_tokens": 4}', "missing 'prompt'"),
        (b'{"prompt": ["a", "b"]}', "'prompt' must be a string"),
        (b'{"prompt": "x", "max_tokens": 0}', "'max_tokens' must be a whole number from 1 to 32"),
        (b'{"prompt": "x", "max_tokens": 33}', "from 1 to 32"),
        (b'{"prompt": "x", "max_tokens": "4"}', "'max_tokens'"),
        (b'{"prompt": "x", "max_tokens": true}', "'max_tokens'"),
        (b'{"prompt": "x", "temperature": 9}', "'temperature'"),
        (b'{"prompt": "x", "stream": "yes"}', "'stream' must be true or false"),
    ],
)
def test_bad_requests_get_400_with_one_line_json(svc: ServiceProc, body: bytes, needle: str):
    st, headers, raw = svc.request("POST", "/v1/completions", body)
    assert st == 400
    assert raw.count(b"\n") == 1 and raw.endswith(b"\n"), raw
    err = json.loads(raw)["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"], err


def test_too_long_prompt_and_unknown_routes(svc: ServiceProc) -> None:
    st, body = svc.complete("word " * 400, 4)
    assert st == 400 and "context length 256" in body["error"]["message"]
    st, _h, raw = svc.request("GET", "/nope")
    assert st == 404 and b"/v1/completions" in raw
    st, h, _raw = svc.request("GET", "/v1/completions")
    assert st == 405 and h.get("Allow") == "POST"


def test_metrics_parse_and_count(svc: ServiceProc) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    svc.complete("count me", 4)
    svc.request("POST", "/v1/completions", b"{bad")
    text = svc.metrics()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in [
        ("gf_service_request_duration_seconds", "histogram"),
        ("gf_service_tokens_generated", "counter"),
        ("gf_service_errors", "counter"),
        ("gf_service_queue_depth", "gauge"),
        ("gf_service_batch_size", "histogram"),
        ("gf_service_breaker_state", "gauge"),
        ("gf_service_worker_last_progress_age_seconds", "gauge"),
    ]:
        assert name in fams and fams[name].type == kind, name
    s = svc.metric_samples()
    assert sample(s, "gf_service_tokens_generated_total", model="primary") >= 4
    assert sample(s, "gf_service_errors_total", kind="bad_request") >= 1
    assert sample(s, "gf_service_request_duration_seconds_count", outcome="ok") >= 1
    assert sample(s, "gf_service_breaker_state") == 0
    assert sample(s, "gf_service_queue_capacity") == 64
    assert sample(s, "gf_service_worker_alive") == 1
    # No CUDA context in a CPU service: no GPU memory series.
    assert "gf_service_gpu_memory_used_bytes" not in fams


def test_health_reports_breaker_queue_and_worker(svc: ServiceProc) -> None:
    st, h = svc.health()
    assert st == 200 and h["status"] == "ok", h
    assert h["breaker"]["state"] == "closed" and h["queue"]["capacity"] == 64
    w = h["worker"]
    assert w["alive"] and w["name"] == "gf-worker" and not w["hung"]
    assert w["last_progress_age_s"] < 5
    comm = Path(f"/proc/{svc.pid}/task/{w['tid']}/comm").read_text().strip()
    assert comm == "gf-worker"  # what `gpufault inject --tid` and ps -L show
    assert h["pid"] == svc.pid and h["libcuda_test_double"] is False


def test_load_shedding_with_a_queue_of_one() -> None:
    s = ServiceProc("--queue-size", "1", "--max-batch", "1", "--batch-wait", "0")
    try:
        res = burst(24, lambda i: s.complete(f"burst {i}", 48))
        codes = [st for st, _ in res]
        assert 200 in codes and 429 in codes, codes
        assert set(codes) <= {200, 429}, codes
        for st, body in res:
            if st == 429:
                assert body["error"]["type"] == "overloaded"
                assert "queue full" in body["error"]["message"]
        sm = s.metric_samples()
        assert sample(sm, "gf_service_errors_total", kind="shed") == codes.count(429)
        assert sample(sm, "gf_service_requests_total", status="429") == codes.count(429)
    finally:
        assert s.close() == 0, s.stderr()


def test_ready_file_and_bad_options(tmp_path: Path) -> None:
    import subprocess
    import sys

    ready = tmp_path / "ready.json"
    s = ServiceProc("--ready-file", str(ready))
    try:
        info = json.loads(ready.read_text())
        assert info["url"] == s.url and info["pid"] == s.pid and info["worker_tid"]
    finally:
        assert s.close() == 0
    assert not ready.exists()  # removed on exit
    r = subprocess.run(
        [sys.executable, "-m", "pyctl.service", "--d-model", "30", "--heads", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--d-model 30 must be a multiple of --heads 4" in r.stderr


@needs_double
def test_real_double_oom_trips_the_breaker_to_the_fallback() -> None:
    """Without BPF: the double's pool (GF_DOUBLE_MEM_MIB=16) really runs out
    for long requests; short ones fit. 1 MiB per token."""
    s = ServiceProc(
        "--device",
        "cpu-double",
        "--double-bytes-per-token",
        str(1 << 20),
        "--breaker-errors",
        "2",
        "--breaker-cooldown",
        "0",
        "--batch-wait",
        "0",
        env={"GF_DOUBLE_MEM_MIB": "16"},
    )
    try:
        assert s.health()[1]["libcuda_test_double"] is True
        big = "word " * 20  # over 16 tokens with max_tokens 8
        for _ in range(2):
            st, body = s.complete(big, 8)
            assert st == 200 and body["degraded"] is True
            assert body["model"] == "gf-tiny-1l-fallback"
        st, h = s.health()
        assert h["breaker"]["state"] == "open" and h["status"] == "degraded", h
        assert "CUDA_ERROR_OUT_OF_MEMORY" in h["breaker"]["last_error"]
        sm = s.metric_samples()
        assert sample(sm, "gf_service_breaker_state") == 2
        assert (
            sample(sm, "gf_service_errors_total", kind="device", code="CUDA_ERROR_OUT_OF_MEMORY")
            == 2
        )
        # cooldown 0: the next batch is the half-open probe; a small one passes.
        st, body = s.complete("hi", 2)
        assert st == 200 and body["degraded"] is False
        assert s.health()[1]["breaker"]["state"] == "closed"
        assert "closed -> open" in s.stderr() and "half-open -> closed" in s.stderr()
    finally:
        assert s.close() == 0, s.stderr()


@needs_double
def test_reject_mode_answers_503() -> None:
    s = ServiceProc(
        "--device",
        "cpu-double",
        "--double-bytes-per-token",
        str(1 << 20),
        "--degrade",
        "reject",
        "--breaker-errors",
        "1",
        "--breaker-cooldown",
        "60s",
        "--batch-wait",
        "0",
        env={"GF_DOUBLE_MEM_MIB": "16"},
    )
    try:
        st, body = s.complete("word " * 20, 8)
        assert st == 503 and "CUDA_ERROR_OUT_OF_MEMORY" in body["error"]["message"]
        st, body = s.complete("hi", 2)  # open: refused without touching the device
        assert st == 503 and "circuit breaker open" in body["error"]["message"]
        st, h = s.health()
        assert st == 503 and h["status"] == "unhealthy", h
    finally:
        assert s.close() == 0, s.stderr()


# ---- input handling: hostile or broken clients (docs/service.md) -----------------
# One service with short timeouts and few handler threads, so that each
# bound shows within a second or two.
HEADER_S, BODY_S = 1.0, 1.0


@pytest.fixture(scope="module")
def strict():
    s = ServiceProc(
        "--batch-wait",
        "0",
        "--max-connections",
        "16",
        "--header-timeout",
        f"{HEADER_S}s",
        "--body-timeout",
        f"{BODY_S}s",
        "--idle-timeout",
        "5s",
    )
    yield s
    assert s.close() == 0, s.stderr()
    assert "Traceback" not in s.stderr() and "Error" not in s.stderr(), s.stderr()


def raw_exchange(s: ServiceProc, data: bytes, timeout: float = 10.0) -> tuple[bytes, float]:
    """Send data on a fresh connection, read until the service closes it:
    (everything it answered, seconds until the close)."""
    import socket
    import time

    c = socket.create_connection((s.host, s.port), timeout=timeout)
    t = time.monotonic()
    try:
        c.sendall(data)
        got = b""
        while chunk := c.recv(65536):
            got += chunk
        return got, time.monotonic() - t
    finally:
        c.close()


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def one_json_line(answer: bytes) -> dict:
    body = answer.split(b"\r\n\r\n", 1)[1]
    assert body.count(b"\n") == 1 and body.endswith(b"\n"), body
    return json.loads(body)


@pytest.mark.parametrize("length", [b"abc", b"\xb2", b"\xb9", b"-1", b"4 4", b"0x10", b"1e3"])
def test_content_length_not_a_number_is_400(strict: ServiceProc, length: bytes) -> None:
    # Headers are Latin-1: b"\xb2" is "²", which passed str.isdigit() and
    # then failed int(): a traceback and a dropped connection.
    req = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %s\r\n\r\n{}" % length
    got, _ = raw_exchange(strict, req)
    assert status_of(got) == 400, got
    assert "Content-Length" in one_json_line(got)["error"]["message"]


@pytest.mark.parametrize("length", [b"99999999", pytest.param(b"9" * 5000, id="5000-digits")])
def test_body_over_the_limit_is_413(strict: ServiceProc, length: bytes) -> None:
    # 5000 digits: int() of more than 4300 digits raises (CVE-2020-10735's limit).
    req = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %s\r\n\r\n" % length
    got, _ = raw_exchange(strict, req)
    assert status_of(got) == 413, got
    one_json_line(got)


def test_deeply_nested_json_is_400(strict: ServiceProc) -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    st, _h, raw = strict.request("POST", "/v1/completions", deep)
    assert st == 400, raw
    assert b"nested too deeply" in raw
    st, _h, raw = strict.request("POST", "/admin/perturb", deep)
    assert st in (400, 404), raw  # closed without --perturb-control: 404 after the body


def test_half_sent_headers_get_408_within_the_header_timeout(strict: ServiceProc) -> None:
    got, took = raw_exchange(strict, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    assert status_of(got) == 408, got
    assert HEADER_S * 0.9 <= took < HEADER_S + 2, took
    # A client that trickles its headers a byte at a time is bounded the same way.
    import socket
    import time

    c = socket.create_connection((strict.host, strict.port), timeout=10)
    t = time.monotonic()
    try:
        c.sendall(b"GET /health HTTP/1.1\r\n")
        c.setblocking(False)
        got = b""
        while time.monotonic() - t < HEADER_S + 3:
            try:
                c.send(b"X")  # never a complete header line
            except OSError:
                break
            try:
                chunk = c.recv(65536)
            except BlockingIOError:
                time.sleep(0.1)  # the trickle's pace, not a synchronization
                continue
            if not chunk:
                break
            got += chunk
    finally:
        c.close()
    assert status_of(got) == 408 and time.monotonic() - t < HEADER_S + 3, got


def test_short_body_gets_408_within_the_body_timeout(strict: ServiceProc) -> None:
    req = b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"pro'
    got, took = raw_exchange(strict, req)
    assert status_of(got) == 408, got
    assert "did not arrive" in one_json_line(got)["error"]["message"]
    assert BODY_S * 0.9 <= took < BODY_S + 2, took


def test_aborted_clients_leave_no_traceback(strict: ServiceProc) -> None:
    import socket
    import struct
    import time

    def answered() -> float:
        return sample(strict.metric_samples(), "gf_service_requests_total")

    before, lines = answered(), len(strict.lines)
    n = 10  # under --max-connections: each is a request the worker runs
    for _ in range(n):
        c = socket.create_connection((strict.host, strict.port), timeout=10)
        # RST at close: the answer's write meets a reset connection.
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        body = json.dumps({"prompt": "hello world", "max_tokens": 4}).encode()
        c.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body
        )
        c.close()
    t = time.monotonic()
    while answered() < before + n and time.monotonic() - t < 30:
        time.sleep(0.05)  # the answers' writes have no event visible from outside
    assert answered() >= before + n
    assert strict.complete("hello", 2)[0] == 200
    assert strict.lines[lines:] == [], strict.lines[lines:]


def test_half_open_connections_do_not_grow_threads(strict: ServiceProc) -> None:
    import os
    import socket
    import time

    def threads() -> int:
        return len(os.listdir(f"/proc/{strict.pid}/task"))

    base = threads()
    socks = []
    try:
        for _ in range(200):
            c = socket.create_connection((strict.host, strict.port), timeout=10)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # and nothing more
            socks.append(c)
        peak = threads()
        # 16 handler threads at most; the other connections are answered 503.
        assert peak <= base + 16, (base, peak)
        refused = 0
        for c in socks:
            c.settimeout(HEADER_S + 5)
            try:
                got = c.recv(65536)
            except (ConnectionResetError, TimeoutError):
                got = b""
            refused += status_of(got) == 503
        print(json.dumps({"threads_base": base, "threads_peak": peak, "answered_503": refused}))
        assert refused >= 200 - 16 - 2, refused
    finally:
        for c in socks:
            c.close()
    t = time.monotonic()
    while threads() > base and time.monotonic() - t < HEADER_S + 5:
        time.sleep(0.05)  # thread exits have no event to wait on from outside
    assert threads() <= base
    assert strict.complete("hello", 2)[0] == 200
