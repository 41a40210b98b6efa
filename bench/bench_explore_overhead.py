"""What `gpufault explore`'s discovery costs the service it traces, as
ratios measured in one run.

The reference service on the libcuda CPU test double (`--device
cpu-double --batch-wait 0`) is driven by closed-loop clients (4
concurrent, 16-token completions), in rounds that alternate untraced (A)
and traced (B), ABAB..., so drift on this shared machine hits both
alike. Traced = the probes discovery arms (pyctl/explore/discover.py):
action signal SIGURG on libcuda `cu*`, libcublas `cublas*` and the
tokenizer's `tok:hf-encode`, each capped at 4000 fires, armed before the
round starts (arming is not measured). Each round stays under the cap, so
every traced call takes the signal path and its stack copy. Reports each
side's median requests/s and p99 and the ratios B/A. Needs root and
`make build`. Writes bench/results/explore-overhead.json.

    sudo python3 bench/bench_explore_overhead.py [--rounds 4] [--requests 80]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from service_proc import ServiceProc, percentile  # noqa: E402

import gpufault  # noqa: E402
from gpufault import Fault  # noqa: E402
from pyctl.explore.discover import DEFAULT_LIBS, MAX_SAMPLES, SAMPLE_SIGNAL  # noqa: E402

LIBS = {k: DEFAULT_LIBS[k] for k in ("libcuda", "libcublas", "tokenizers")}


def load_round(s: ServiceProc, n: int, clients: int, tokens: int) -> tuple[float, float, int]:
    """(requests/s, p99 seconds, answers that were not 200) of n requests."""
    with ThreadPoolExecutor(clients) as ex:
        t = time.monotonic()
        res = list(
            ex.map(
                lambda i: s.timed_complete(prompt=f"request {i} a few words", max_tokens=tokens),
                range(n),
            )
        )
        el = time.monotonic() - t
    return n / el, percentile([r[0] for r in res], 99), sum(1 for r in res if r[1] != 200)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    specs = [
        Fault.signal(lib, fn, signal=SAMPLE_SIGNAL, max=MAX_SAMPLES) for lib, fn in LIBS.items()
    ]
    side: dict[str, list[tuple[float, float, int]]] = {"A": [], "B": []}
    fires = calls = 0
    s = ServiceProc("--device", "cpu-double", "--batch-wait", "0")
    try:
        for i in range(10):
            s.complete(f"warm {i}", 2)
        with tempfile.TemporaryDirectory() as d:
            for r in range(a.rounds):
                side["A"].append(load_round(s, a.requests, a.clients, a.tokens))
                with gpufault.arm(specs, s.pid, db=Path(d) / f"r{r}.db") as h:
                    side["B"].append(load_round(s, a.requests, a.clients, a.tokens))
                    c = h.counters
                    fires += c.fires
                    calls += c.calls
    finally:
        s.close()

    def med(k: str, i: int) -> float:
        return statistics.median(x[i] for x in side[k])

    out = {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "probes": {k: v for k, v in LIBS.items()},
        "rounds": a.rounds,
        "requests_per_round": a.requests,
        "clients": a.clients,
        "tokens": a.tokens,
        "traced_calls": calls,
        "traced_fires": fires,
        "untraced": {
            "requests_per_s": round(med("A", 0), 2),
            "p99_ms": round(med("A", 1) * 1e3, 1),
            "not_200": sum(x[2] for x in side["A"]),
        },
        "traced": {
            "requests_per_s": round(med("B", 0), 2),
            "p99_ms": round(med("B", 1) * 1e3, 1),
            "not_200": sum(x[2] for x in side["B"]),
        },
        "rounds_raw": {
            k: [(round(x[0], 2), round(x[1] * 1e3, 1)) for x in v] for k, v in side.items()
        },
    }
    out["throughput_ratio"] = round(med("B", 0) / med("A", 0), 3)
    out["p99_ratio"] = round(med("B", 1) / med("A", 1), 3)
    res = REPO / "bench" / "results" / "explore-overhead.json"
    res.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
