"""What an experiment's probes cost the service they watch (issue 14).

The reference service (--device cpu) answers an open-loop load of 300
requests/s (dynamic batching keeps up with it here, so throughput itself
cannot move); what the probes can cost is the service's CPU time (from
/proc/PID/stat over the window) and its latency (p50, p99 from when each
request was due). Rounds alternate between no probes and
the probe set of the shipped cuda-oom-degrade experiment (two /health http
probes and one /metrics metric probe, every 250 ms each, as there) plus,
in a third arm, the same set at 50 ms (20x the default rate of 1 s). One
run, interleaved rounds, medians; ratios = throughput with probes /
the same without (CPU seconds per 1,000 answers; p99).

    python3 bench/bench_probe_cost.py [ROUNDS] [--out bench/results/probe-cost-host.json]
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from service_proc import ServiceProc  # noqa: E402

from pyctl.experiment.loadgen import OpenLoopLoad, window_stats  # noqa: E402
from pyctl.experiment.probes import probe_from_toml  # noqa: E402

RATE = float(os.environ.get("GF_BENCH_RATE", "100"))  # requests/s (open loop)
WINDOW_S = 6.0


def probes(url: str, interval: str) -> list:
    tables = {
        "healthy": {"kind": "http", "url": f"{url}/health", "json_path": "status",
                    "tolerance": "ok", "timeout": "2s", "interval": interval},
        "degraded": {"kind": "http", "url": f"{url}/health", "json_path": "status",
                     "tolerance": "degraded", "timeout": "2s", "interval": interval},
        "breaker-open": {"kind": "metric", "url": f"{url}/metrics",
                         "name": "gf_service_breaker_state", "tolerance": "== 2",
                         "timeout": "2s", "interval": interval},
    }
    return [probe_from_toml(n, t, f"bench:{n}") for n, t in tables.items()]


def sample_loop(p, every: float, stop: threading.Event, n: list[int]) -> None:
    nxt = time.monotonic()
    while not stop.is_set():
        p.sample()
        n[0] += 1
        nxt += every
        stop.wait(max(0.0, nxt - time.monotonic()))


def cpu_s(pid: int) -> float:
    """utime + stime of every thread of pid, seconds."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / 100.0  # USER_HZ is 100 on Linux


def one_round(url: str, pid: int, every: float | None) -> dict:
    stop = threading.Event()
    count = [0]
    threads = []
    if every is not None:
        for p in probes(url, f"{every}s"):
            th = threading.Thread(target=sample_loop, args=(p, every, stop, count), daemon=True)
            threads.append(th)
            th.start()
    load = OpenLoopLoad(url, RATE, prompt="hello world", max_tokens=4, timeout=3.0)
    t0 = time.time()
    c0 = cpu_s(pid)
    load.start()
    stop.wait(WINDOW_S)
    c1 = cpu_s(pid)
    load.stop()
    stop.set()
    for th in threads:
        th.join()
    # Throughput of answered requests over the window (due time in it).
    w = window_stats(load.samples(t0 + 1.0, t0 + WINDOW_S), t0 + 1.0, t0 + WINDOW_S)
    return {"throughput": w.throughput, "p50_ms": w.p50 * 1e3, "p99_ms": w.p99 * 1e3,
            "cpu_per_1k": (c1 - c0) / max(1, w.count) * 1000 * (WINDOW_S - 1.0) / WINDOW_S,
            "probe_samples": count[0]}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 4
    out_path = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    arms = {"none": None, "250ms": 0.25, "50ms": 0.05}
    res: dict[str, list[dict]] = {k: [] for k in arms}
    svc = ServiceProc("--device", "cpu", "--batch-wait", "0")
    try:
        one_round(svc.url, svc.pid, None)  # warm-up
        for _ in range(rounds):
            for name, every in arms.items():
                res[name].append(one_round(svc.url, svc.pid, every))
    finally:
        svc.close()
    def med(arm: str, key: str) -> float:
        return statistics.median(r[key] for r in res[arm])

    doc = {
        "kernel": platform.release(),
        "rate": RATE,
        "window_s": WINDOW_S,
        "rounds": rounds,
        "arms": {
            k: {
                "throughput": round(med(k, "throughput"), 1),
                "cpu_s_per_1k_answers": round(med(k, "cpu_per_1k"), 3),
                "cpu_ratio": round(med(k, "cpu_per_1k") / med("none", "cpu_per_1k"), 3),
                "p50_ms": round(med(k, "p50_ms"), 2),
                "p99_ms": round(med(k, "p99_ms"), 2),
                "p99_ratio": round(med(k, "p99_ms") / med("none", "p99_ms"), 3),
                "probe_samples_per_s": round(med(k, "probe_samples") / WINDOW_S, 1),
            }
            for k in res
        },
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if out_path:
        Path(out_path).write_text(text + "\n")


if __name__ == "__main__":
    main()
