"""Throughput and latency of the reference inference service (pyctl/service/).

For each device mode (cpu, cpu-double) and batch wait (0, 10ms), starts the
service on port 0, warms it up, and drives it with closed-loop clients
(1 and 8 concurrent, keep-alive off: one connection per request, as the
tests do) asking for 16-token completions. Reports requests/s, tokens/s,
p50/p99 client latency and the mean batch size from /metrics. The clients
share the machine's cores with the service, so this is a floor, not the
service's capacity on a bigger host.

    python3 bench/bench_service.py [--requests 200] [--tokens 16]

Prints JSON (one object per configuration).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from service_proc import ServiceProc, percentile, sample  # noqa: E402


def one(mode: str, wait: str, conc: int, n: int, tokens: int) -> dict[str, object]:
    s = ServiceProc("--device", mode, "--batch-wait", wait)
    try:
        for i in range(10):
            s.complete(f"warm {i}", 2)
        before = s.metric_samples()
        with ThreadPoolExecutor(conc) as ex:
            t = time.monotonic()
            res = list(
                ex.map(
                    lambda i: s.timed_complete(
                        prompt=f"request {i} with a few words", max_tokens=tokens
                    ),
                    range(n),
                )
            )
            el = time.monotonic() - t
        after = s.metric_samples()
        lat = [r[0] for r in res]
        batches = sample(after, "gf_service_batch_size_count") - sample(
            before, "gf_service_batch_size_count"
        )
        return {
            "device": mode,
            "batch_wait": wait,
            "clients": conc,
            "requests": n,
            "ok": sum(1 for r in res if r[1] == 200),
            "requests_per_s": round(n / el, 1),
            "tokens_per_s": round(n * tokens / el),
            "p50_ms": round(percentile(lat, 50) * 1e3, 1),
            "p99_ms": round(percentile(lat, 99) * 1e3, 1),
            "mean_batch": round(n / batches, 2) if batches else None,
        }
    finally:
        s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    for mode in ("cpu", "cpu-double"):
        for wait in ("0", "10ms"):
            for conc in (1, 8):
                print(json.dumps(one(mode, wait, conc, a.requests, a.tokens)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
