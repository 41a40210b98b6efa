"""How `gpufault explore`'s run time grows with the number of trials.

build/targets/gf_sites (two call sites of gf_alloc, three faults each:
-1, a 300 ms stall, a hang: six trials in all) explored with --max-runs
1, 2, 4 and 6 in one run of this script, each exploration from scratch
(its own discovery). A least-squares line through (trials, total
seconds) gives the fixed cost (discovery, planning) and the cost per
trial; the residuals say whether it is linear. Trials are points x
faults: gf_sites has two points, so this grows the trials, not the
points (a target with more sites would add points the same way: one
trial each per fault). Needs root and `make build`. Writes
bench/results/explore-scaling.json.

    sudo python3 bench/bench_explore_scaling.py
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import gpufault  # noqa: E402

SITES = REPO / "build" / "targets" / "gf_sites"
LIB = REPO / "build" / "targets" / "libgftarget.so"
RUNS = (1, 2, 4, 6)

FILE = f"""name = "scaling"
version = 1
title = "bench"
[target]
command = ["{SITES}"]
[load]
rate = 20
prompt = "hello"
max_tokens = 2
timeout = "1s"
[phases]
warmup = "0.5s"
baseline = "1s"
[steady_state]
error_rate = "<= 1%"
p99 = "<= 800ms"  # a timing bench: a busy machine must not fail the pre-check
"""


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "sites.toml"
        f.write_text(FILE)
        for n in RUNS:
            t0 = time.monotonic()
            x = gpufault.explore(
                f,
                db=Path(d) / f"s{n}.db",
                libs={str(LIB): "gf_alloc"},
                discover_s=2.0,
                window_s=2.0,
                stall="300ms",
                recover="1s",
                hold="1s",
                max_runs=n,
            )
            rows.append(
                {
                    "max_runs": n,
                    "trials": len(x.trials),
                    "points_found": x.coverage["points_found"],
                    "total_s": round(time.monotonic() - t0, 2),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    a, b = fit([r["trials"] for r in rows], [r["total_s"] for r in rows])
    for r in rows:
        r["fit_residual_s"] = round(r["total_s"] - (a + b * r["trials"]), 2)
    out = {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": rows,
        "fixed_s": round(a, 2),
        "per_trial_s": round(b, 2),
    }
    res = REPO / "bench" / "results" / "explore-scaling.json"
    res.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
