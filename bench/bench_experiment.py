"""How long an experiment's start and abort take (root, the real service).

Runs the shipped worker-hang-abort experiment N times (a shorter baseline)
through the runner's API and measures, per run:

- target: from the call to the experiment row (the service started and
  printed its ready line, URL and pid checked);
- arm: from a step's planned start to its child controller's armed line
  (Python start-up, BPF load, attach, ptrace seize);
- abort: from the guard's abort decision to the step's run row closed
  (disarmed, the hung thread released, detached) and to the child's exit;
- the whole call (service stop included).

    sudo python3 bench/bench_experiment.py [N] [--out bench/results/experiment-host.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pyctl.experiment import load as F  # noqa: E402
from pyctl.experiment import run as runner  # noqa: E402


def one(tmp: Path, i: int) -> dict[str, float]:
    text = F.find("worker-hang-abort").read_text().replace('baseline = "4s"', 'baseline = "2s"')
    f = tmp / "worker-hang-abort.toml"
    f.write_text(text)
    t = time.time()
    out = runner.run(F.load(str(f)), str(tmp / f"bench-{i}.db"), echo=lambda s: None)
    done = time.time()
    assert out.verdict.verdict == "aborted", out.verdict
    s = out.steps[0]
    assert s.fault is not None and out.abort_at is not None
    return {
        "target_s": out.started_at - t,
        "arm_s": s.fault.started_at - s.planned_start,
        "abort_to_run_closed_ms": ((s.ended_at or 0) - out.abort_at) * 1e3,
        "abort_to_child_exit_ms": ((s.fault.ended_at or 0) - out.abort_at) * 1e3,
        "guard_after_arm_s": out.abort_at - s.fault.started_at,
        "call_s": done - t,
    }


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 3
    with tempfile.TemporaryDirectory(prefix="bench-exp-") as d:
        runs = [one(Path(d), i) for i in range(n)]
    summary = {
        k: {
            "median": round(statistics.median(r[k] for r in runs), 3),
            "max": round(max(r[k] for r in runs), 3),
        }
        for k in runs[0]
    }
    doc = {
        "experiment": "worker-hang-abort",
        "runs": n,
        "summary": summary,
        "each": [{k: round(v, 3) for k, v in r.items()} for r in runs],
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if "--out" in sys.argv:
        Path(sys.argv[sys.argv.index("--out") + 1]).write_text(text + "\n")


if __name__ == "__main__":
    main()
