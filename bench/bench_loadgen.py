"""How accurate is the open-loop load generator, and what does a probe cost?

Against tests/delay_server.py in its own process (so it does not share
the generator's GIL): every request answered after 20 ms; the server
records how long each one really took (sleep overshoot included), which is
the truth the generator's numbers are compared with.

- steady: 200 requests/s for 10 s: measured p50/p99 vs the true p50/p99,
  the schedule lag (scheduler wake-up after each due time) p50/p99/max,
  and each request's send lag (sent - due) p99.
- stall: the same, with the delay at 200 ms for 1 s in the middle: do the
  requests due during the stall show it (latency >= 200 ms)? Once with 64
  connections (the generator can keep sending) and once with 8 (it cannot:
  40 would be in flight), where latency from the due time is compared with
  what a closed-loop client would report (from when it could send).
- probes: time per sample of each probe kind, against the reference
  service (`python -m pyctl.service --device cpu`) where it applies.

    python3 bench/bench_loadgen.py        # JSON on stdout; ~40 s
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from pyctl.experiment.loadgen import OpenLoopLoad, Sample  # noqa: E402
from pyctl.experiment.probes import ProbeError, probe_from_toml  # noqa: E402

RATE = float(os.environ.get("GF_BENCH_RATE", "200"))
DELAY, STALL_DELAY, STALL_FOR = 0.020, 0.200, 1.0


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    h = (len(s) - 1) * q
    lo = int(h)
    return s[lo] + (h - lo) * (s[min(lo + 1, len(s) - 1)] - s[lo])


def _ms(x: float) -> float:
    return round(x * 1e3, 3)


def _server(*args: str) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "delay_server.py"), *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    port = int(p.stdout.readline())  # printed once it listens
    return p, f"http://127.0.0.1:{port}"


def _truth(url: str) -> list[tuple[float, float]]:
    import urllib.request

    with urllib.request.urlopen(url + "/log", timeout=10) as r:
        return [tuple(x) for x in json.load(r)]


def _load(url: str, seconds: float, concurrency: int) -> tuple[list[Sample], dict[str, Any]]:
    load = OpenLoopLoad(url, RATE, duration=seconds, concurrency=concurrency, timeout=5.0)
    load.start()
    load.wait()
    load.stop()
    return load.samples(), load.counts()


def steady() -> dict[str, Any]:
    srv, url = _server("--delay", str(DELAY))
    try:
        _load(url, 1.0, 64)  # warm-up: connections, code paths
        t_start = time.time()
        s, c = _load(url, 10.0, 64)
        truth = [took for t, took in _truth(url) if t >= t_start]
    finally:
        srv.terminate()
        srv.wait()
    lat = [x.latency for x in s]
    sent = [x.done - x.sent for x in s]
    return {
        "rate": RATE,
        "requests": len(s),
        "errors": c["errors"],
        "measured_p50_ms": _ms(_q(lat, 0.5)),
        "true_p50_ms": _ms(_q(truth, 0.5)),
        "measured_p99_ms": _ms(_q(lat, 0.99)),
        "true_p99_ms": _ms(_q(truth, 0.99)),
        "p99_error_ms": _ms(_q(lat, 0.99) - _q(truth, 0.99)),
        "p50_error_ms": _ms(_q(lat, 0.5) - _q(truth, 0.5)),
        # latency from when it was sent: the measurement's own error, the
        # generator's late sending (counted on purpose above) taken out
        "from_sent_p99_ms": _ms(_q(sent, 0.99)),
        "from_sent_p99_error_ms": _ms(_q(sent, 0.99) - _q(truth, 0.99)),
        "sched_lag_ms": {k: round(v, 3) for k, v in c["sched_lag_ms"].items()},
        "send_lag_p50_ms": _ms(_q([x.lag for x in s], 0.5)),
        "send_lag_p99_ms": _ms(_q([x.lag for x in s], 0.99)),
        "achieved_rate": round((len(s) - 1) / (s[-1].due - s[0].due), 2),
    }


def stall(concurrency: int) -> dict[str, Any]:
    at = time.time() + 4.0  # after a 1 s warm-up and 2 s of steady load
    srv, url = _server(
        "--delay",
        str(DELAY),
        "--stall-at",
        str(at),
        "--stall-for",
        str(STALL_FOR),
        "--stall-delay",
        str(STALL_DELAY),
    )
    try:
        _load(url, 1.0, concurrency)
        s, c = _load(url, 6.0, concurrency)
        truth = _truth(url)
    finally:
        srv.terminate()
        srv.wait()
    during = [x for x in s if at <= x.due < at + STALL_FOR]
    lat = [x.latency for x in during]
    closed = [x.done - x.sent for x in during]  # what a closed-loop client would time
    true_during = [took for t, took in truth if at <= t < at + STALL_FOR]
    return {
        "concurrency": concurrency,
        "requests": len(s),
        "errors": c["errors"],
        "due_during_stall": len(during),
        "share_due_during_stall_with_latency_ge_200ms": round(
            sum(1 for x in lat if x >= STALL_DELAY) / len(lat), 4
        ),
        "stall_min_latency_ms": _ms(min(lat)),
        "stall_p50_ms": _ms(_q(lat, 0.5)),
        "stall_p99_ms": _ms(_q(lat, 0.99)),
        "stall_closed_loop_view_p50_ms": _ms(_q(closed, 0.5)),
        "stall_closed_loop_view_p99_ms": _ms(_q(closed, 0.99)),
        "server_answered_during_stall": len(true_during),
        "server_true_p50_during_stall_ms": _ms(_q(true_during, 0.5)) if true_during else None,
        "overall_measured_p99_ms": _ms(_q([x.latency for x in s], 0.99)),
        "sched_lag_ms": {k: round(v, 3) for k, v in c["sched_lag_ms"].items()},
    }


class _PromStandIn(BaseHTTPRequestHandler):
    """A STAND-IN for Prometheus's /api/v1/query (the documented JSON), so
    the probe's own cost can be timed; not Prometheus."""

    def log_message(self, *a: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps(
            {
                "status": "success",
                "data": {
                    "resultType": "vector",
                    "result": [{"metric": {"job": "svc"}, "value": [time.time(), "0.021"]}],
                },
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _time_probe(table: dict[str, Any], n: int) -> dict[str, Any]:
    try:
        p = probe_from_toml("bench", table, "bench")
    except ProbeError as e:
        return {"skipped": str(e)}
    first = p.sample()  # imports, first connection
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = p.sample()
        ts.append(time.perf_counter() - t0)
    return {
        "ok": first.ok and r.ok,
        "median_ms": _ms(statistics.median(ts)),
        "p90_ms": _ms(_q(ts, 0.9)),
        "samples": n,
        "detail": r.detail[:100],
    }


def probes() -> dict[str, Any]:
    from service_proc import ServiceProc

    prom = ThreadingHTTPServer(("127.0.0.1", 0), _PromStandIn)
    threading.Thread(target=prom.serve_forever, daemon=True).start()
    prom_url = f"http://127.0.0.1:{prom.server_address[1]}"
    svc = ServiceProc("--device", "cpu")
    out: dict[str, Any] = {}
    try:
        url = svc.url
        out["http /health breaker.state"] = _time_probe(
            {
                "kind": "http",
                "url": url + "/health",
                "json_path": "breaker.state",
                "tolerance": "closed",
            },
            200,
        )
        out["metric /metrics gf_service_breaker_state"] = _time_probe(
            {
                "kind": "metric",
                "url": url + "/metrics",
                "name": "gf_service_breaker_state",
                "tolerance": 0,
            },
            100,
        )
        out["prometheus (stand-in server) vector"] = _time_probe(
            {"kind": "prometheus", "url": prom_url, "query": "up", "tolerance": "<= 0.2"}, 200
        )
        out["command true"] = _time_probe({"kind": "command", "command": "true"}, 100)
        out["process pid"] = _time_probe({"kind": "process", "pid": svc.pid}, 1000)
        out["process name (scans /proc)"] = _time_probe(
            {"kind": "process", "name": "gf-worker-none", "tolerance": False}, 100
        )
        out["nvml memory_used"] = _time_probe(
            {"kind": "nvml", "check": "memory_used", "tolerance": ">= 0"}, 100
        )
    finally:
        svc.close()
        prom.shutdown()
        prom.server_close()
    return out


def main() -> None:
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg()[0],
        "python": sys.version.split()[0],
        "server_delay_ms": DELAY * 1e3,
    }
    for key, fn in (
        ("steady", steady),
        ("stall_64", lambda: stall(64)),
        ("stall_8", lambda: stall(8)),
        ("probes", probes),
    ):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001 - keep the other sections' numbers
            out[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    out["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
