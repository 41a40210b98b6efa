"""The library's session costs, in one run on this machine: how long
gpufault.arm() takes to return armed and disarm() to return detached, in
this process and as an isolated child controller, beside the same fault
through the command line (`gpufault inject --pid`, spawn to its start-up
line, SIGINT to exit). The target is build/targets/gf_target; each round
arms a fail on gf_victim's 1st call, checks that exactly that call
failed, and disarms. Medians of REPS interleaved rounds; ratios to the
CLI's. Prints JSON. Needs root and `make build`.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gftarget import LIB, Target  # noqa: E402

import gpufault  # noqa: E402

REPS = int(os.environ.get("GF_BENCH_API_REPS", "7"))


def api_round(t: Target, db: str, isolate: bool) -> tuple[float, float]:
    spec = gpufault.Fault.fail(str(LIB), "gf_victim", ret=-5, nth=1)
    t0 = time.perf_counter()
    h = gpufault.arm(spec, t.pid, db=db, duration=60, isolate=isolate)
    armed = time.perf_counter() - t0
    rows = t.victim(2)
    assert [r[3] for r in rows] == [-5, 3], rows
    assert h.wait_fires(1, timeout=10)
    t1 = time.perf_counter()
    h.disarm()
    return armed * 1e3, (time.perf_counter() - t1) * 1e3


def cli_round(t: Target, db: str) -> tuple[float, float]:
    argv = [sys.executable, "-m", "pyctl", "inject", "--pid", str(t.pid), "--lib", str(LIB),
            "--fn", "gf_victim", "--action", "fail", "--ret", "-5", "--nth", "1", "--db", db,
            "--duration", "60s"]  # fmt: skip
    env = dict(os.environ, GPUFAULT_NO_SERVER="1", PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
    assert p.stderr is not None
    for line in p.stderr:
        if "Ctrl-C to end" in line:
            break
    else:
        raise RuntimeError(f"inject ended before arming: {p.wait()}")
    armed = time.perf_counter() - t0
    rows = t.victim(2)
    assert [r[3] for r in rows] == [-5, 3], rows
    t1 = time.perf_counter()
    p.send_signal(signal.SIGINT)
    p.stderr.read()
    p.wait()
    return armed * 1e3, (time.perf_counter() - t1) * 1e3


def main() -> None:
    if os.geteuid() != 0:
        sys.exit("bench_api: run as root")
    raw: dict[str, list[tuple[float, float]]] = {"in_process": [], "isolated": [], "cli": []}
    t = Target()
    d = tempfile.mkdtemp(prefix="gf-bench-api-")
    try:
        for i in range(REPS):
            db = f"{d}/r{i}.db"
            raw["in_process"].append(api_round(t, db, isolate=False))
            raw["isolated"].append(api_round(t, db, isolate=True))
            raw["cli"].append(cli_round(t, db))
    finally:
        t.close()
    med = {
        k: {
            "arm_ms": round(statistics.median(a for a, _ in v), 1),
            "disarm_ms": round(statistics.median(b for _, b in v), 1),
        }
        for k, v in raw.items()
    }
    out = {
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count()},
        "reps": REPS,
        **med,
        "ratio_to_cli": {
            k: {m: round(med[k][m] / med["cli"][m], 3) for m in ("arm_ms", "disarm_ms")}
            for k in ("in_process", "isolated")
        },
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
