"""`gpufault explore` end to end on this machine: discovery time (the
discovery experiment: target start, warmup, baseline, sampling window,
recovery), time per trial (one experiment per caller site and fault:
target start, warmup, baseline, fault window, recovery and hold), and
points tried per minute. Two targets: build/targets/gf_sites (two call
sites of gf_alloc; a C server that starts in milliseconds) and the
reference service on the libcuda CPU test double (`gpufault service
--device cpu-double`; five points). Writes bench/results/explore-host.json
and prints it. Needs root and `make build`.
GF_BENCH_EXPLORE_SERVICE_RUNS: the service's trial count (default 6).
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import gpufault  # noqa: E402

SITES = REPO / "build" / "targets" / "gf_sites"
LIB = REPO / "build" / "targets" / "libgftarget.so"
SERVICE_RUNS = int(os.environ.get("GF_BENCH_EXPLORE_SERVICE_RUNS", "6"))

LOAD = """
[load]
rate = 20
prompt = "hello world"
max_tokens = {tokens}
timeout = "2s"
[phases]
warmup = "{warmup}"
baseline = "{baseline}"
[steady_state]
error_rate = "<= 1%"
p99 = "<= {p99}"
"""


def one(name: str, target: str, load: str, libs: dict[str, str], tmp: Path, **kw: object) -> dict:
    f = tmp / f"{name}.toml"
    f.write_text(f'name = "{name}"\nversion = 1\ntitle = "bench"\n[target]\n{target}\n{load}')
    db = tmp / f"{name}.db"
    t0 = time.monotonic()
    x = gpufault.explore(f, db=db, libs=libs, **kw)  # type: ignore[arg-type]
    total = time.monotonic() - t0
    con = sqlite3.connect(db)
    (started, disc_exp) = con.execute(
        "SELECT started_at, discover_experiment FROM explorations"
    ).fetchone()
    (d0, d1) = con.execute(
        "SELECT started_at, ended_at FROM experiments WHERE id=?", (disc_exp,)
    ).fetchone()
    trials = con.execute("SELECT ended_at - started_at, outcome FROM explore_trials").fetchall()
    per = [t for t, _ in trials]
    return {
        "points_found": x.coverage["points_found"],
        "points_tried": x.coverage["points_tried"],
        "trials": len(trials),
        "outcomes": {o: sum(1 for _, oo in trials if oo == o) for _, o in trials},
        "discover_s": round(d1 - d0, 2),
        "discover_wall_s": round(d1 - started, 2),
        "per_trial_s_mean": round(sum(per) / len(per), 2) if per else None,
        "per_trial_s_max": round(max(per), 2) if per else None,
        "total_s": round(total, 2),
        "trials_per_min": round(len(trials) / total * 60, 2),
        "points_tried_per_min": round(x.coverage["points_tried"] / total * 60, 2),
    }


def main() -> None:
    out: dict = {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out["gf_sites"] = one(
            "bench-sites",
            f'command = ["{SITES}"]',
            LOAD.format(tokens=2, warmup="0.5s", baseline="1s", p99="200ms"),
            {str(LIB): "gf_alloc"},
            tmp,
            discover_s=2.0,
            window_s=2.0,
            stall="300ms",
            recover="1s",
            hold="1s",
        )
        out["service_cpu_double"] = one(
            "bench-service",
            'service = { device = "cpu-double", args = ["--batch-wait", "0", '
            '"--breaker-errors", "3", "--breaker-cooldown", "500ms"] }',
            LOAD.format(tokens=4, warmup="1s", baseline="2s", p99="500ms"),
            {"libcuda": "cu*", "libcublas": "cublas*"},
            tmp,
            discover_s=3.0,
            window_s=2.0,
            hang=False,
            max_runs=SERVICE_RUNS,
            recover="2s",
            hold="1s",
        )
    res = REPO / "bench" / "results" / "explore-host.json"
    res.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
