#!/usr/bin/env python3
"""Copilot latency: from the signal-delivery-stop to the thread resumed
with the injected error. JSON on stdout. Needs root and gcc.

Two numbers per placement (tracer and tracee on the same CPU, then on
different CPUs):
- call_ns: the whole injected call as the target measures it (CLOCK_MONOTONIC
  around the call: tgkill, the stop, the copilot's work, the resume);
- tracer_ns: the copilot's own share, from the moment its waitpid returned
  the stop to the moment PTRACE_CONT returned (Outcome.resume_ns - stop_ns).
baseline_ns is the same call with no tracer attached (the signal is ignored).

usage: bench/bench_copilot.py [--calls N] [--no-block-sigchld]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # an installed gpufault (the wheel) wins, else this checkout

from pyctl.copilot import (  # noqa: E402
    GF_ACT_FAIL,
    Copilot,
    Injection,
    Outcome,
    block_sigchld,
    ptrace,
)

SOURCE = REPO / "tests" / "targets" / "copilot_target.c"
CHUNK = 1000  # calls per "loop" command (the target's line limit)


class Target:
    def __init__(self, exe: Path, cpu: int) -> None:
        self.proc = subprocess.Popen(
            ["taskset", "-c", str(cpu), str(exe)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = int(self._line("ready").split("=")[1])

    def _line(self, tag: str) -> str:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        while True:
            line = out.readline()
            if not line:
                raise SystemExit(f"bench: target ended before {tag!r}")
            if line.startswith(tag):
                return line.strip()

    def loop(self, n: int) -> tuple[int, list[int]]:
        """n timed calls: (calls that did not run the body normally, ns each)."""
        bad, ns = 0, []
        while n > 0:
            k = min(n, CHUNK)
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"loop {k}\n")
            self.proc.stdin.flush()
            words = self._line("loop").split()
            bad += int(words[1].split("=")[1])
            ns += [int(x) for x in words[2:]]
            n -= k
        return bad, ns

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


class Double:
    """Test double for the BPF pending map (as in tests/test_copilot.py):
    every stop is a fail injection built from the registers at the stop."""

    def __init__(self) -> None:
        self.seq = 0

    def fetch(self, tid: int) -> Injection | None:
        try:
            regs = ptrace.getregs(tid)[:21]
        except OSError:
            return None
        self.seq += 1
        return Injection(self.seq, tuple(regs), -2, 0, 0, GF_ACT_FAIL, 0)


def summary(values: list[int]) -> dict[str, float]:
    v = sorted(values)
    return {
        "n": len(v),
        "median": statistics.median(v),
        "p99": v[min(len(v) - 1, int(len(v) * 0.99))],
        "min": v[0],
        "max": v[-1],
    }


def measure(exe: Path, target_cpu: int, tracer_cpu: int, calls: int) -> dict[str, object]:
    # Pin this thread first: the tracer thread started below inherits it.
    os.sched_setaffinity(0, {tracer_cpu})
    t = Target(exe, target_cpu)
    try:
        _, base = t.loop(calls)
        outcomes: list[Outcome] = []
        with Copilot(t.pid, signal.SIGURG, Double().fetch, outcomes.append):
            t.loop(min(calls, 200))  # warm-up
            outcomes.clear()
            bad, call = t.loop(calls)
        if bad != calls:
            raise SystemExit(f"bench: {calls - bad} calls were not injected")
        tracer = [o.resume_ns - o.stop_ns for o in outcomes if o.error is None]
        return {
            "target_cpu": target_cpu,
            "tracer_cpu": tracer_cpu,
            "call_ns": summary(call),
            "tracer_ns": summary(tracer),
            "baseline_ns": summary(base),
        }
    finally:
        t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument(
        "--no-block-sigchld",
        action="store_true",
        help="leave SIGCHLD unblocked in the main thread (worst case)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root (ptrace); run it with sudo")
    if shutil.which("gcc") is None or shutil.which("taskset") is None:
        raise SystemExit("bench: needs gcc and taskset (apt-get install gcc util-linux)")
    cpus = sorted(os.sched_getaffinity(0))
    if not args.no_block_sigchld:
        block_sigchld()
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "copilot_target"
        subprocess.run(["gcc", "-O2", "-pthread", "-o", str(exe), str(SOURCE)], check=True)
        result: dict[str, object] = {
            "calls": args.calls,
            "sigchld_blocked_in_main": not args.no_block_sigchld,
            "cpus": len(cpus),
            "loadavg": open("/proc/loadavg").read().split()[:3],
            "same_cpu": measure(exe, cpus[0], cpus[0], args.calls),
        }
        if len(cpus) > 1:
            result["cross_cpu"] = measure(exe, cpus[0], cpus[1], args.calls)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
