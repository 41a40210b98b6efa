"""`make bench`: run every benchmark on this machine, JSON to bench/results/.

docs/benchmarks.md quotes these files; re-running overwrites them, so look
at the diff before committing new numbers. VM and GPU benchmarks are run
separately (see the docs).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"

RUNS = [
    ("engine-host.json", ["bench_engine.py"]),
    ("fail-host.json", ["bench_fail.py"]),
    ("copilot-host.json", ["bench_copilot.py"]),
    ("tokenizer-bpf.json", ["bench_tokenizer_bpf.py"]),
    ("detach-host.json", ["bench_detach.py"]),
    ("fires-host.json", ["bench_fires.py"]),
    ("loadgen-host.json", ["bench_loadgen.py"]),
    ("loadgen-stream-host.json", ["bench_loadgen_stream.py"]),
    ("aggregate-host.json", ["bench_aggregate.py"]),
    ("attach-host.json", ["bench_attach.py"]),
    ("select-host.json", ["bench_select.py"]),
    ("probe-cost-host.json", ["bench_probe_cost.py", "4"]),
]


def main() -> int:
    RESULTS.mkdir(exist_ok=True)
    failed = 0
    for out, argv in RUNS:
        print(f"bench: {argv[0]} -> bench/results/{out}", file=sys.stderr, flush=True)
        res = subprocess.run(
            [sys.executable, str(BENCH / argv[0]), *argv[1:]], capture_output=True, text=True
        )
        if res.returncode != 0:
            failed += 1
            print(res.stderr[-2000:], file=sys.stderr)
            continue
        (RESULTS / out).write_text(res.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
