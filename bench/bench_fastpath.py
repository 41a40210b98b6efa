"""Injected-failure latency of the signal fast path (issue 26) beside the
ptrace copilot, libfiu and gpufault's LD_PRELOAD shim, in one run.

Every call of the libcuda TEST DOUBLE's cuMemAlloc_v2 fails with 2
(CUDA_ERROR_OUT_OF_MEMORY), timed by the process itself around the call
(bench/fastpath_loop.c, CLOCK_MONOTONIC), in two shapes: a plain loop (one
thread) and a threaded-server shape (2 and 4 threads, ~2 us of work per
request).

- none:    no fault (the call runs)
- libfiu:  the call site has a libfiu point (fiu_return_on), enabled always
           (Debian's libfiu-dev 1.1)
- shim:    pyctl/data/preload/gfpreload.so, GPUFAULT_PRELOAD every=1:ret=2
- signal:  gpufault's engine, signal mechanism (gfsig.so loaded at attach)
- copilot: gpufault's engine, ptrace copilot

`sudo python3 bench/bench_fastpath.py [-o bench/results/fastpath-host.json]`
prints JSON (GF_BENCH_FAILS calls per thread-set, default 20000).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# A fires ring that holds a whole run's fires (~520 B each): a full ring
# skips fires (exactly counted), and this bench wants every call failed.
os.environ.setdefault("GPUFAULT_FIRES_RING_BYTES", str(64 << 20))

from pyctl.engine import Engine  # noqa: E402
from pyctl.paths import DOUBLE_LIBCUDA, DOUBLES, PRELOAD_SHIM  # noqa: E402
from pyctl.spec import FaultSpec  # noqa: E402

N = int(os.environ.get("GF_BENCH_FAILS", "20000"))
PAT = re.compile(r"n=(\d+) p50=(\d+) p99=(\d+) max=(\d+) failed=(\d+)")
# GF_LOOP_SCHED=1 (--sched): what the scheduler did inside the timed calls.
SCHED = re.compile(r"(preempted|voluntary|p99_unpreempted|p50_preempted)=(\d+)")
HOWS = ("none", "libfiu", "shim", "signal", "copilot")
# shape -> threads: the server shape with as many threads as this machine
# has CPUs (2) and with twice as many (threads preempt each other mid-call).
SHAPES = {"plain": 1, "server2": 2, "server4": 4}


def build(out: Path) -> Path:
    """The loop, compiled here; GF_FASTPATH_EXE names one built elsewhere
    (a machine without a compiler or libfiu's headers: the GPU host)."""
    if pre := os.environ.get("GF_FASTPATH_EXE"):
        return Path(pre)
    exe = out / "fastpath_loop"
    subprocess.run(
        ["cc", "-O2", "-Wall", "-fcf-protection=none", "-o", str(exe),
         str(REPO / "bench" / "fastpath_loop.c"), "-lfiu", f"-L{DOUBLES}", "-l:libcuda.so.1",
         f"-Wl,-rpath,{DOUBLES}", "-lpthread"],
        check=True,
    )  # fmt: skip
    return exe


def one(exe: Path, shape: str, how: str, db: Path, drain: bool = True) -> dict:
    threads = SHAPES[shape]
    env = dict(os.environ)
    argv = [str(exe), shape.rstrip("0123456789"), str(threads), str(N // threads)]
    if how == "libfiu":
        argv.append("fiu")
    if how == "shim":
        env["LD_PRELOAD"] = str(PRELOAD_SHIM)
        env["GPUFAULT_PRELOAD"] = "cuMemAlloc_v2:every=1:ret=2"
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None and p.stdin is not None
    pid = int(p.stdout.readline().split()[1])
    eng = None
    try:
        if how in ("signal", "copilot"):
            spec = FaultSpec(
                lib=str(DOUBLE_LIBCUDA), fn="cuMemAlloc_v2", action="fail", ret=2, every=1,
                capture_stack=False, tgid=pid,
            )  # fmt: skip
            eng = Engine([spec], db_path=db, pid=pid, argv=["bench-fastpath"], mechanism=how)
            eng.start()
            assert eng.mechanism == how, (eng.mechanism, eng.signal_refusal)
        done = threading.Event()
        drainer = None
        if eng is not None and drain:
            # The controller's share: fires become evidence while the calls
            # run (a full fires ring would skip fires, exactly counted).
            def drain(e: Engine = eng) -> None:
                while not done.is_set():
                    e.poll(timeout=0.05)  # the CLI's loop: epoll on the rings

            drainer = threading.Thread(target=drain)
            drainer.start()
        t0 = time.monotonic()
        p.stdin.write("go\n")
        p.stdin.flush()
        line = p.stdout.readline()
        wall = time.monotonic() - t0
        done.set()
        if drainer is not None:
            drainer.join()
        if eng is not None:
            eng.drain()
            r_lost = eng.lost()
    finally:
        if eng is not None:
            eng.close()
        p.stdin.close()
        p.wait(30)
    m = PAT.match(line)
    assert m, line
    n, p50, p99, mx, failed = (int(x) for x in m.groups())
    r = {"calls": n, "p50_ns": p50, "p99_ns": p99, "max_ns": mx, "failed": failed}
    r["wall_s"] = round(wall, 3)
    r.update({k: int(v) for k, v in SCHED.findall(line)})
    if eng is not None:
        r["fires_skipped"] = r_lost.get("fires_skipped", 0)
    if eng is not None and how == "signal":
        r["helper"] = eng.signal_counters
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", type=Path)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset")
    ap.add_argument("--hows", default=",".join(HOWS), help="comma-separated subset")
    ap.add_argument("--sched", action="store_true",
                    help="count preempted and sleeping calls inside the timed window "
                    "(GF_LOOP_SCHED=1: two getrusage calls per iteration, outside it)")
    ap.add_argument("--no-drain", action="store_true",
                    help="the controller reads no fires during the calls (after them)")
    args = ap.parse_args()
    if args.sched:
        os.environ["GF_LOOP_SCHED"] = "1"
    out: dict = {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg()[0],
        "calls": N,
        "when_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    with tempfile.TemporaryDirectory() as d:
        exe = build(Path(d))
        for shape in args.shapes.split(","):
            res: dict = {}
            for how in args.hows.split(","):
                res[how] = one(exe, shape, how, Path(d) / f"{shape}-{how}.db", not args.no_drain)
                r = res[how]
                if how != "none":  # exact: what the target saw = what was fired
                    assert r["failed"] == r["calls"] - r.get("fires_skipped", 0), (how, r)
                if how == "signal":
                    assert r["helper"]["handled"] == r["failed"], r
            if set(HOWS) <= set(res):
                sig = res["signal"]
                res["signal_over_libfiu_p50"] = round(sig["p50_ns"] / res["libfiu"]["p50_ns"], 1)
                res["signal_over_shim_p50"] = round(sig["p50_ns"] / res["shim"]["p50_ns"], 1)
                res["copilot_over_signal_p50"] = round(
                    res["copilot"]["p50_ns"] / sig["p50_ns"], 1
                )
            out[shape] = res
    out["loadavg_end"] = os.getloadavg()[0]
    text = json.dumps(out, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
