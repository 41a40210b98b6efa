"""What does a streamed request cost the open-loop load generator, and how
fast can it stream?

A Server-Sent Events server of known timing runs in its own process (so
it does not share the generator's GIL): each POST is answered with
`tokens` OpenAI-style chunks, the first `first` seconds after the request
arrived, then one every `gap` seconds, then `data: [DONE]`.

- accuracy: 50 requests/s for 6 s of 8 tokens, first 10 ms, gap 5 ms:
  the measured TTFT and ITL p50/p99 against what the server was told and
  against what it did (its own log of each request's first write and the
  gaps between its writes, GET /log): the errors are measured - true.
- overhead: the generator's own CPU time (this process's, the server is
  another) per request and per token chunk, streamed (stream=True, every
  chunk parsed and stamped) vs the same answers read whole (stream=False),
  at 100 requests/s of 16 tokens sent at once (gap 0).
- per token: CPU seconds of the generator / tokens received, for streams
  of one write per token (32 tokens, 2 ms apart) at 25 and 100 requests/s,
  and the marginal cost per token between the two rates.
- ceiling: offered rates from 100 to 6400 requests/s (doubling) for 3 s each, 8
  tokens at once: the highest rate the generator sustained (every request
  scheduled and sent, answered ok, schedule lag p99 under 10 ms), with the
  server's own limit said where it was the one that gave out.

    python3 bench/bench_loadgen_stream.py     # JSON on stdout; ~60 s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pyctl.experiment.loadgen import OpenLoopLoad, Sample, window_stats  # noqa: E402


def _q(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    h = (len(s) - 1) * q
    lo = int(h)
    return s[lo] + (h - lo) * (s[min(lo + 1, len(s) - 1)] - s[lo])


def _ms(x: float) -> float:
    return round(x * 1e3, 3)


# ---- the server (its own process) ---------------------------------------------------------


class _H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: Any

    def log_message(self, *a: Any) -> None:
        pass

    def do_GET(self) -> None:  # /log: the truth, per request [ttft, gap, gap, ...] seconds
        with self.server.lock:
            body = json.dumps(self.server.log).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        at = time.monotonic()  # the request read (its headers): the truth starts here
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        first, gap, k = self.server.timing
        wrote: list[float] = []
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if first:
            time.sleep(max(0.0, at + first - time.monotonic()))
        out = []
        for i in range(k):
            if i and gap:
                time.sleep(max(0.0, at + first + i * gap - time.monotonic()))
            ev = b'data: {"choices": [{"index": 0, "text": "t%d "}]}\n\n' % i
            out.append(b"%x\r\n%s\r\n" % (len(ev), ev))
            if gap:
                self.wfile.write(b"".join(out))
                self.wfile.flush()
                wrote.append(time.monotonic())
                out = []
        done = b"data: [DONE]\n\n"
        out.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        self.wfile.write(b"".join(out))
        self.wfile.flush()
        if gap:
            truth = [wrote[0] - at] + [b - a for a, b in zip(wrote, wrote[1:], strict=False)]
            with self.server.lock:
                self.server.log.append(truth)


def serve(first: float, gap: float, tokens: int) -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _H)
    srv.daemon_threads = True
    srv.request_queue_size = 512
    srv.timing = (first, gap, tokens)  # type: ignore[attr-defined]
    srv.lock = threading.Lock()  # type: ignore[attr-defined]
    srv.log = []  # type: ignore[attr-defined]
    print(srv.server_address[1], flush=True)
    srv.serve_forever()


def _server(first: float, gap: float, tokens: int) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(first), str(gap), str(tokens)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    port = p.stdout.readline().strip()
    return p, f"http://127.0.0.1:{port}"


def _run(url: str, rate: float, seconds: float, stream: bool, conc: int = 64) -> dict[str, Any]:
    load = OpenLoopLoad(
        url, rate, stream=stream, duration=seconds, concurrency=conc, timeout=5.0, max_tokens=8
    )
    c0 = time.process_time()
    load.start()
    load.wait(seconds + 30)
    load.stop()
    cpu = time.process_time() - c0
    got: list[Sample] = load.samples()
    c = load.counts()
    return {"samples": got, "counts": c, "cpu_s": cpu}


def accuracy() -> dict[str, Any]:
    p, url = _server(0.010, 0.005, 8)
    try:
        r = _run(url, 50, 6.0, True)
        with urllib.request.urlopen(url + "/log", timeout=10) as resp:
            log: list[list[float]] = json.load(resp)
    finally:
        p.terminate()
        p.wait(5)
    s = [x for x in r["samples"] if x.ok]
    ttft = [x.ttft for x in s]
    gaps = [g for x in s for g in x.itl]
    # The truth: what the server did (first chunk written - request read,
    # then the gaps between its writes), its sleep overshoot included.
    t_ttft = [x[0] for x in log]
    t_gaps = [g for x in log for g in x[1:]]
    # TTFT from when each request was sent: the measurement's own error,
    # without the generator's late sending (which counts in `ttft` on purpose)
    from_sent = [x.ttft - x.lag for x in s]
    w = window_stats(s, s[0].due, s[-1].due + 1e-3)

    def err(a: list[float], b: list[float], q: float) -> float:
        return _ms(_q(a, q) - _q(b, q))

    return {
        "rate": 50,
        "requests": len(r["samples"]),
        "ok": len(s),
        "told": {"first_ms": 10, "gap_ms": 5, "tokens": 8},
        "ttft_ms": {"p50": _ms(_q(ttft, 0.5)), "p99": _ms(_q(ttft, 0.99))},
        "true_ttft_ms": {"p50": _ms(_q(t_ttft, 0.5)), "p99": _ms(_q(t_ttft, 0.99))},
        "ttft_error_ms": {"p50": err(ttft, t_ttft, 0.5), "p99": err(ttft, t_ttft, 0.99)},
        "ttft_from_sent_error_ms": {
            "p50": err(from_sent, t_ttft, 0.5),
            "p99": err(from_sent, t_ttft, 0.99),
        },
        "itl_ms": {"p50": _ms(_q(gaps, 0.5)), "p99": _ms(_q(gaps, 0.99))},
        "true_itl_ms": {"p50": _ms(_q(t_gaps, 0.5)), "p99": _ms(_q(t_gaps, 0.99))},
        "itl_error_ms": {"p50": err(gaps, t_gaps, 0.5), "p99": err(gaps, t_gaps, 0.99)},
        "tokens_per_request": sorted({x.tokens for x in s}),
        "output_tokens_per_s": round(w.output_tokens_per_s, 1),
        "sched_lag_ms": r["counts"]["sched_lag_ms"],
    }


def overhead() -> dict[str, Any]:
    p, url = _server(0.0, 0.0, 16)
    out: dict[str, Any] = {"rate": 100, "seconds": 5, "tokens": 16}
    try:
        for stream in (False, True):
            r = _run(url, 100, 5.0, stream)
            n = len(r["samples"])
            key = "streamed" if stream else "whole"
            out[key] = {
                "requests": n,
                "ok": sum(1 for x in r["samples"] if x.ok),
                "cpu_us_per_request": round(r["cpu_s"] / n * 1e6, 1),
                "latency_p50_ms": _ms(_q([x.latency for x in r["samples"]], 0.5)),
            }
        toks = sum(x.tokens for x in r["samples"])
        out["streamed"]["tokens"] = toks
        out["streamed"]["cpu_us_per_token"] = round(r["cpu_s"] / max(1, toks) * 1e6, 2)
        out["streamed"]["cpu_us_per_chunk"] = round(
            out["streamed"]["cpu_us_per_request"] / 17, 1
        )  # 16 tokens + [DONE]
        out["stream_extra_cpu_us_per_request"] = round(
            out["streamed"]["cpu_us_per_request"] - out["whole"]["cpu_us_per_request"], 1
        )
    finally:
        p.terminate()
        p.wait(5)
    return out


def per_token() -> dict[str, Any]:
    """CPU seconds of the generator process / tokens it received, for a
    stream of one write per token (32 tokens 2 ms apart, the shape of a
    real decode), at 25 and 100 requests/s: the cost that scales with
    tokens, next to the per-request part (the slope between the two
    rates' CPU per second over their token rates)."""
    p, url = _server(0.0, 0.002, 32)
    out: dict[str, Any] = {"tokens_per_request": 32, "gap_ms": 2, "seconds": 5}
    try:
        for rate in (25, 100):
            r = _run(url, rate, 5.0, True)
            toks = sum(x.tokens for x in r["samples"] if x.ok)
            out[f"rate_{rate}"] = {
                "requests": len(r["samples"]),
                "ok": sum(1 for x in r["samples"] if x.ok),
                "tokens": toks,
                "cpu_s": round(r["cpu_s"], 4),
                "cpu_us_per_token": round(r["cpu_s"] / max(1, toks) * 1e6, 2),
                "tokens_per_s": round(toks / 5.0, 1),
            }
        lo, hi = out["rate_25"], out["rate_100"]
        # marginal cost: extra CPU / extra tokens (idle wake-ups cancel out)
        out["marginal_cpu_us_per_token"] = round(
            (hi["cpu_s"] - lo["cpu_s"]) / max(1, hi["tokens"] - lo["tokens"]) * 1e6, 2
        )
    finally:
        p.terminate()
        p.wait(5)
    return out


def ceiling() -> dict[str, Any]:
    p, url = _server(0.0, 0.0, 8)
    steps = []
    best = 0.0
    try:
        for rate in (100, 200, 400, 800, 1600, 3200, 6400):
            r = _run(url, rate, 3.0, True, conc=128)
            c = r["counts"]
            n = len(r["samples"])
            ok = sum(1 for x in r["samples"] if x.ok)
            lag99 = c["sched_lag_ms"]["p99"] or 0.0
            sent_all = c["sent"] == c["scheduled"] == n
            held = sent_all and ok == n and lag99 < 10.0
            steps.append(
                {
                    "offered_rps": rate,
                    "requests": n,
                    "ok": ok,
                    "sent_all": sent_all,
                    "errors": c["errors"],
                    "sched_lag_p99_ms": round(lag99, 3),
                    "latency_p99_ms": _ms(_q([x.latency for x in r["samples"]], 0.99)),
                    "ttft_p99_ms": _ms(_q([x.ttft for x in r["samples"] if x.ok], 0.99)),
                    "cpu_s_per_s": round(r["cpu_s"] / 3.0, 2),
                    "sustained": held,
                }
            )
            if held:
                best = rate
            else:
                break
    finally:
        p.terminate()
        p.wait(5)
    return {"steps": steps, "max_sustained_rps": best}


def main() -> None:
    t = time.monotonic()
    out = {
        "host": os.uname().nodename,
        "cpus": os.cpu_count(),
        "load_avg_start": os.getloadavg(),
        "accuracy": accuracy(),
        "overhead": overhead(),
        "per_token": per_token(),
        "ceiling": ceiling(),
    }
    out["load_avg_end"] = os.getloadavg()
    out["seconds"] = round(time.monotonic() - t, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        serve(float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
