"""What the stack copy costs a fire, and how fast the controller unwinds it.

1. Capture cost per fire: the target (gf_target's gf_victim, a worker
   thread) makes N calls that all fire (action signal with SIGWINCH, which
   the target ignores: the fire's own work and an ignored signal, no
   copilot), with no stack, with the frame-pointer stack only, and with a
   copy of 8, 16 and 32 KiB. The cost is the entry program's own run time
   per fire, from the kernel's BPF run-time statistics (bpf_enable_stats,
   as `bpftool prog profile`; on while this bench holds its descriptor):
   the target's wall time per call on this shared 2-core machine is
   ~70 us of command I/O and noise, far above the difference. Each setting is its own process
   (GPUFAULT_STACK_COPY_BYTES is read at load). Bytes: what the copies
   held (a shallow thread's stack ends before 32 KiB).
2. Unwinding rate: the copies of the C++ target without frame pointers
   (build/targets/gf_nofp_cc), unwound again and again from what the
   fires stored: frames per second, first (tables read) and warm.

JSON on stdout; docs/benchmarks.md has the numbers.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))
sys.path.insert(0, str(REPO / "tests"))

N = int(os.environ.get("GF_BENCH_UNWIND_CALLS", "3000"))
ROUNDS = int(os.environ.get("GF_BENCH_UNWIND_ROUNDS", "3"))


def _run_time(prog_fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a program: struct bpf_prog_info at 192, 200."""
    import ctypes as C

    from pyctl.bpf import libbpf

    get = libbpf.lib().bpf_obj_get_info_by_fd
    get.argtypes = [C.c_int, C.c_void_p, C.POINTER(C.c_uint32)]
    info = (C.c_uint8 * 256)()
    n = C.c_uint32(256)
    if get(prog_fd, info, C.byref(n)) != 0:
        raise SystemExit("bpf_obj_get_info_by_fd failed")
    raw = bytes(info)
    return int.from_bytes(raw[192:200], "little"), int.from_bytes(raw[200:208], "little")


def capture(stack: bool) -> dict:
    """One setting, in this process (its GPUFAULT_STACK_COPY_BYTES)."""
    from gftarget import LIB, Target

    from pyctl.bpf import libbpf
    from pyctl.engine import Engine
    from pyctl.spec import FaultSpec

    t = Target()
    copied: list[int] = []
    with tempfile.TemporaryDirectory() as d:
        spec = FaultSpec(lib=str(LIB), fn="gf_victim", action="signal",
                         signo=int(signal.SIGWINCH), every=1, capture_stack=stack,
                         tgid=t.pid)  # fmt: skip
        eng = Engine([spec], db_path=Path(d) / "u.db", pid=t.pid, argv=["bench-unwind"])
        eng.start()
        orig = eng.evidence.take_ustack

        def take(rec: bytes) -> None:
            orig(rec)
            copied.append(len(next(reversed(eng.evidence.ustacks.values()))[1]))

        eng.evidence.take_ustack = take  # type: ignore[method-assign]
        try:
            t.victim(200)  # warm-up: tables read, pages touched
            eng.drain()
            prog_fd = libbpf.lib().bpf_program__fd(eng.obj.program(eng.plan.programs[0]))
            per_call, per_fire = [], []
            for _ in range(ROUNDS):
                stats_fd = libbpf.lib().bpf_enable_stats(0)  # BPF_STATS_RUN_TIME
                if stats_fd < 0:
                    raise SystemExit("bpf_enable_stats failed: needs root and kernel 5.8+")
                t_run0, n_run0 = _run_time(prog_fd)
                t0 = time.perf_counter()
                t.victim(N)
                per_call.append((time.perf_counter() - t0) / N * 1e9)
                t_run1, n_run1 = _run_time(prog_fd)
                os.close(stats_fd)
                per_fire.append((t_run1 - t_run0) / max(1, n_run1 - n_run0))
                eng.drain()
            lost = eng.lost()
        finally:
            eng.close()
            t.close()
    return {"bpf_ns_per_fire": round(min(per_fire)), "bpf_rounds_ns": [round(x) for x in per_fire],
            "target_ns_per_call": round(min(per_call)),
            "copies": len(copied), "copy_bytes_mean": round(sum(copied) / len(copied))
            if copied else 0, "fires_skipped": lost.get("fires_skipped", 0)}  # fmt: skip


def unwinding() -> dict:
    """Unwind the stored copies of gf_nofp_cc's fires, many times."""
    from pyctl.engine import Engine
    from pyctl.spec import FaultSpec
    from pyctl.symbols import unwind
    from pyctl.symbols.maps import Maps

    exe = REPO / "build" / "targets" / "gf_nofp_cc"
    held: list[tuple[dict, tuple[int, bytes]]] = []
    with tempfile.TemporaryDirectory() as d:
        r, w = os.pipe()
        p = subprocess.Popen(["/bin/sh", "-c", f'read -r _ < /proc/self/fd/{r}; exec "$@"',
                              "hold", str(exe), "200"], pass_fds=(r,),
                             stdout=subprocess.DEVNULL)  # fmt: skip
        os.close(r)
        spec = FaultSpec(lib=str(exe), fn="_ZN6gfnofp4leafEl", action="signal",
                         signo=int(signal.SIGWINCH), every=1, tgid=p.pid)  # fmt: skip
        eng = Engine([spec], db_path=Path(d) / "w.db", pid=p.pid, argv=["bench-unwind"],
                     resolve_in_target=False)  # fmt: skip
        eng.start()
        frames_of = eng.evidence._frames

        def keep(ev, a, fid, regs):  # type: ignore[no-untyped-def]
            copy = eng.evidence.ustacks.get(ev.fault_seq)
            if copy is not None:
                held.append((dict(regs), copy))
            return frames_of(ev, a, fid, regs)

        eng.evidence._frames = keep  # type: ignore[method-assign]
        try:
            os.write(w, b"go\n")
            os.close(w)
            p.wait(60)
            eng.drain()
            maps = eng.evidence.mapwatch[p.pid].maps()
        finally:
            eng.close()
    unwind._BY_KEY.clear()
    unwind._BY_BUILD_ID.clear()
    unwind._BY_PATH.clear()
    maps = Maps(list(maps.maps))  # no memo: the first stack reads the tables
    t0 = time.perf_counter()
    first = unwind.unwind(held[0][0], unwind.Stack(*held[0][1]), maps)
    cold = time.perf_counter() - t0
    n = 0
    t0 = time.perf_counter()
    for _ in range(5):
        for regs, copy in held:
            n += len(unwind.unwind(regs, unwind.Stack(*copy), maps).frames)
    warm = time.perf_counter() - t0
    return {"stacks": len(held), "frames_per_stack": len(first.frames),
            "first_stack_ms": round(cold * 1e3, 1), "warm_frames_per_s": round(n / warm),
            "warm_stacks_per_s": round(5 * len(held) / warm)}  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(json.dumps(capture(sys.argv[2] == "stack")))
        return
    out: dict = {"kernel": platform.release(), "calls": N, "capture": {}}
    settings = [("no stack", "none", None), ("frame pointers only", "stack", "0"),
                ("fp + 8 KiB copy", "stack", "8192"), ("fp + 16 KiB copy", "stack", "16384"),
                ("fp + 32 KiB copy", "stack", "32768")]  # fmt: skip
    for name, stack, copy in settings:
        env = dict(os.environ)
        if copy is not None:
            env["GPUFAULT_STACK_COPY_BYTES"] = copy
        env["GPUFAULT_NO_EARLY_LOAD"] = "1"
        r = subprocess.run([sys.executable, __file__, "--one", stack], env=env,
                           capture_output=True, text=True, check=True)  # fmt: skip
        out["capture"][name] = json.loads(r.stdout.strip().splitlines()[-1])
    out["unwind"] = unwinding()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
