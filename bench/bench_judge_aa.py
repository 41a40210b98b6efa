"""The default judge's false-alarm rate, live (issue 23: "measure its
false-alarm rate with A/A runs (a fault that never fires, repeated at
least 20 times here while the machine is busy): it must stay at or under
alpha").

Runs the shipped `control` experiment (the same load, phases and judge as
the others, no fault) N times through the runner's API while `--hog K`
processes spin on the CPU beside it, and counts the runs whose judgement
row says worse: the default judge's, and the per-request judge's that
its reason carries for comparison. Prints the counts, the load average
before, during and after, and the one-sided 95 % upper bound on the
false-alarm rate (Clopper-Pearson: 0 of 20 bounds it at 13.9 %, so 20
runs can show a judge is not badly wrong, not that it is at 1 %).

    sudo python3 bench/bench_judge_aa.py [N] [--hog K] [--file NAME_OR_PATH]
        [--out bench/results/judge-aa-host.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pyctl.experiment import load as F  # noqa: E402
from pyctl.experiment import run as runner  # noqa: E402


def upper_bound(k: int, n: int, conf: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound of a rate seen k times in n:
    the p at which P(X <= k) = 1 - conf (bisection on the binomial CDF)."""
    if k >= n:
        return 1.0

    def cdf(p: float) -> float:
        return math.fsum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > 1 - conf else (lo, mid)
    return hi


def loadavg() -> float:
    return os.getloadavg()[0]


def one(exp: Any, db: Path) -> dict[str, Any]:
    out = runner.run(exp, str(db), echo=lambda s: None)
    c = sqlite3.connect(db)
    try:
        row = c.execute(
            "SELECT worse, p_value, effect, reason FROM judgements "
            "WHERE experiment_id = ? AND metric = 'latency'",
            (out.experiment_id,),
        ).fetchone()
    finally:
        c.close()
    worse, p, effect, reason = row if row else (None, None, None, "no judgement row")
    return {
        "experiment": out.experiment_id,
        "verdict": out.verdict.verdict,
        "verdict_reason": out.verdict.reason,
        "worse": bool(worse),
        "p": p,
        "effect": effect,
        "per_request_worse": "(not deciding): worse" in (reason or ""),
        "load": round(loadavg(), 2),
        "reason": reason,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", nargs="?", type=int, default=20)
    ap.add_argument("--hog", type=int, default=1, help="CPU spinners beside the runs")
    ap.add_argument("--file", default="control", help="the A/A experiment (no fault)")
    ap.add_argument("--out", help="write the runs and counts here as JSON")
    a = ap.parse_args()
    exp = F.load(a.file)
    if exp.steps:
        print(f"{a.file}: has fault steps; an A/A run needs none (or one that never fires)")
    before = loadavg()
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(a.hog)
    ]  # fmt: skip
    runs: list[dict[str, Any]] = []
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-judge-aa-") as d:
            for i in range(a.n):
                r = one(exp, Path(d) / "aa.db")
                runs.append(r)
                print(
                    f"run {i + 1:2}/{a.n}: {r['verdict']:7} judge "
                    f"{'WORSE' if r['worse'] else 'not worse'} (p={r['p']:.3g}, "
                    f"{r['effect']:.2f}x), per request "
                    f"{'worse' if r['per_request_worse'] else 'not worse'}, load {r['load']}",
                    flush=True,
                )
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    took = time.time() - t0
    after = loadavg()
    n = len(runs)
    worse = sum(r["worse"] for r in runs)
    per_req = sum(r["per_request_worse"] for r in runs)
    alpha = exp.steady.judge.alpha if exp.steady.judge else float("nan")
    summary = {
        "file": a.file,
        "runs": n,
        "hogs": a.hog,
        "alpha": alpha,
        "judge_worse": worse,
        "judge_upper95": round(upper_bound(worse, n), 4),
        "per_request_worse": per_req,
        "per_request_upper95": round(upper_bound(per_req, n), 4),
        "verdicts": {v: sum(r["verdict"] == v for r in runs) for v in {r["verdict"] for r in runs}},
        "load_before": round(before, 2),
        "load_during": [min(r["load"] for r in runs), max(r["load"] for r in runs)],
        "load_after": round(after, 2),
        "seconds": round(took, 1),
    }
    print(
        f"\n{a.file} x{n} beside {a.hog} CPU hog(s), load average {before:.2f} before, "
        f"{summary['load_during'][0]}-{summary['load_during'][1]} during: "
        f"default judge (alpha {alpha:g}) worse in {worse}/{n} "
        f"(95% upper bound {summary['judge_upper95'] * 100:.1f}%); per-request judge "
        f"worse in {per_req}/{n} ({summary['per_request_upper95'] * 100:.1f}%); "
        f"verdicts {summary['verdicts']}; {took:.0f}s"
    )
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
