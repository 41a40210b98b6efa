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

--shape server (issue 26): the threaded-server shape instead, through
gpufault's whole engine (BPF fires, the copilot with what it does while a
thread is held, the ring drained meanwhile), beside the signal path in the
same run: a CPython target (bench/copilot_server_target.py) whose worker
thread calls the libcuda TEST DOUBLE's cuMemAlloc_v2 through ctypes while
its other threads sit in poll, recv and accept and one Python thread takes
the GIL half the time; one call in `--every` fails with 2. Per mechanism:
the failed calls as the target timed them, the calls that ran, and for the
copilot how long it held each thread (its stop to its resume). --torch
imports torch in the target first (a real server's maps and libraries);
--lib names another libcuda (the real driver's, on a GPU host: its
cuMemAlloc_v2 without a context returns 3, each failed one 2);
--no-python-work leaves out the thread that takes the target's GIL (a
failed call that took long waits for the GIL on its way back to Python:
the target's own cost of a long hold, not the mechanism's).

usage: bench/bench_copilot.py [--calls N] [--no-block-sigchld]
       bench/bench_copilot.py --shape server [--calls N] [--every K] [--gap-us U] [--torch]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

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


SERVER_TARGET = REPO / "bench" / "copilot_server_target.py"


def _held_ns(db: Path) -> list[int]:
    """How long the copilot held each failed call's thread (its outcome)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        out = []
        for (text,) in con.execute("SELECT outcome FROM faults"):
            cop = json.loads(text or "{}").get("copilot") or {}
            if cop.get("resume_ns") and cop.get("stop_ns"):
                out.append(cop["resume_ns"] - cop["stop_ns"])
        return out
    finally:
        con.close()


def server_shape(
    how: str,
    calls: int,
    every: int,
    gap_us: int,
    torch: bool,
    tmp: Path,
    gil_work: str = "1",
    lib: str = "",
) -> dict[str, Any]:
    """One mechanism in the threaded-server shape (the module's docstring)."""
    # lazy: the engine only for this shape (the copilot bench needs none of it)
    from pyctl.engine import Engine
    from pyctl.paths import DOUBLE_LIBCUDA
    from pyctl.spec import FaultSpec

    lib = lib or str(DOUBLE_LIBCUDA)
    env = dict(os.environ, GF_SHAPE_TORCH="1" if torch else "0", GF_SHAPE_GIL=gil_work)
    proc = subprocess.Popen(
        [sys.executable, "-I", str(SERVER_TARGET), lib],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def go(n: int) -> dict[str, list[int]]:
        stdin.write(f"go {n} {gap_us}\n")
        stdin.flush()
        line = stdout.readline()
        if not line.startswith("done "):
            raise SystemExit(f"bench: the server-shape target said {line!r}")
        return json.loads(line[5:])

    db = Path(tempfile.mkdtemp(dir=tmp)) / f"server-{how}.db"  # one a round
    try:
        pid = int(stdout.readline().split()[1])
        spec = FaultSpec(
            lib=lib, fn="cuMemAlloc_v2", action="fail", ret=2, every=every, tgid=pid,
        )  # fmt: skip
        eng = Engine([spec], db_path=db, pid=pid, argv=["bench-copilot-server"], mechanism=how)
        eng.start()
        if eng.mechanism != how:
            raise SystemExit(f"bench: asked for {how}, got {eng.mechanism}: {eng.signal_refusal}")
        done = threading.Event()

        def drain() -> None:  # the CLI's loop: epoll on the rings
            while not done.is_set():
                eng.poll(timeout=0.05)

        drainer = threading.Thread(target=drain)
        drainer.start()
        try:
            first = go(every)  # the first fire of the run (its own row)
            r = go(calls)
        finally:
            done.set()
            drainer.join()
            eng.drain()
            eng.close()
    finally:
        stdin.write("quit\n")
        stdin.close()
        proc.wait(30)
    failed = [ns for ns, rc in zip(r["ns"], r["rc"], strict=True) if rc == 2]
    ran = [ns for ns, rc in zip(r["ns"], r["rc"], strict=True) if rc != 2]
    if len(failed) != calls // every:
        raise SystemExit(f"bench: {how}: {len(failed)} calls failed, {calls // every} expected")
    res: dict[str, object] = {
        "first_failed_ns": max(
            ns for ns, rc in zip(first["ns"], first["rc"], strict=True) if rc == 2
        ),
        "failed_ns": summary(failed),
        "ran_ns": summary(ran),
    }
    if how == "copilot":
        held = _held_ns(db)
        res["held_ns"] = summary(held[1:])  # less the first run's fire (first_failed_ns)
    return res


def main_server(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result: dict[str, object] = {
            "shape": "server",
            "calls": args.calls,
            "every": args.every,
            "gap_us": args.gap_us,
            "torch": args.torch,
            "python_work": not args.no_python_work,
            "lib": args.lib or "the libcuda TEST DOUBLE",
            "cpus": len(os.sched_getaffinity(0)),
            "loadavg": open("/proc/loadavg").read().split()[:3],
        }
        rounds: list[dict[str, Any]] = []
        for _ in range(args.rounds):
            one: dict[str, Any] = {
                how: server_shape(
                    how,
                    args.calls,
                    args.every,
                    args.gap_us,
                    args.torch,
                    Path(tmp),
                    "0" if args.no_python_work else "1",
                    args.lib,
                )  # fmt: skip
                for how in ("signal", "copilot")
            }
            sig, cop = one["signal"], one["copilot"]
            assert isinstance(sig["failed_ns"], dict) and isinstance(cop["failed_ns"], dict)
            one["copilot_over_signal_p50"] = round(
                cop["failed_ns"]["median"] / sig["failed_ns"]["median"], 1
            )
            rounds.append(one)
        result["rounds"] = rounds
        result["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    json.dump(result, sys.stdout, indent=2)
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--shape", choices=("loop", "server"), default="loop")
    ap.add_argument("--every", type=int, default=20, help="server: one call in K fails")
    ap.add_argument("--gap-us", type=int, default=500, help="server: between calls")
    ap.add_argument("--torch", action="store_true", help="server: import torch in the target")
    ap.add_argument("--rounds", type=int, default=3, help="server: rounds, mechanisms alternating")
    ap.add_argument("--lib", default="", help="server: the libcuda (default: the TEST DOUBLE)")
    ap.add_argument(
        "--no-python-work",
        action="store_true",
        help="server: no thread taking the target's GIL (the mechanism without the GIL's wait)",
    )
    ap.add_argument(
        "--no-block-sigchld",
        action="store_true",
        help="leave SIGCHLD unblocked in the main thread (worst case)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root (ptrace); run it with sudo")
    if not args.no_block_sigchld:
        block_sigchld()
    if args.shape == "server":
        main_server(args)
        return
    if shutil.which("gcc") is None or shutil.which("taskset") is None:
        raise SystemExit("bench: needs gcc and taskset (apt-get install gcc util-linux)")
    cpus = sorted(os.sched_getaffinity(0))
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
