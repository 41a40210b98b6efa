"""Target selectors' costs, in one run on this machine:

- resolution: how long Target.comm / cgroup / ranks_of / container take to
  resolve (each scans /proc; container also reads the runtimes' state),
  with the machine's own processes plus EXTRA idle ones, beside a plain
  pid (nothing to resolve);
- arming: gpufault.arm() of a fail on gf_victim's 1st call in N
  gf_target processes chosen by --comm (a SessionGroup of N isolated
  sessions, armed in parallel) against one isolated session by pid, for
  N = 1, 2, 4, 8; each round checks that exactly the 1st call of every
  member failed, then disarms.

Medians of REPS interleaved rounds; ratios to the single-pid session.
Prints JSON. Needs root and `make build`.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gftarget import LIB, TARGET, Target  # noqa: E402

import gpufault  # noqa: E402
from pyctl.targets import procfs  # noqa: E402

REPS = int(os.environ.get("GF_BENCH_SELECT_REPS", "5"))
EXTRA = int(os.environ.get("GF_BENCH_SELECT_EXTRA", "200"))
SIZES = (1, 2, 4, 8)


def _ms(f, reps: int = REPS) -> float:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        out.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(out), 2)


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="gf-bench-select-"))
    name = "gfbs" + secrets.token_hex(4)
    (tmp / name).symlink_to(TARGET)
    idle = [subprocess.Popen(["sleep", "600"]) for _ in range(EXTRA)]
    targets = [Target(tmp / name) for _ in range(max(SIZES))]
    # One name per group size: the n processes of that name (a process's
    # comm is its own to change, not ours).
    names = {n: f"gfb{n}" + secrets.token_hex(4) for n in SIZES}
    for n in SIZES:
        (tmp / names[n]).symlink_to(TARGET)
    groups = {n: [Target(tmp / names[n]) for _ in range(n)] for n in SIZES}
    cg_root = next((ln.split(" - ")[0].split()[4] for ln in
                    Path("/proc/self/mountinfo").read_text().splitlines()
                    if " - cgroup2 " in ln), None)  # fmt: skip
    cg = f"/gfbench-{secrets.token_hex(3)}" if cg_root else None
    try:
        if cg and cg_root:
            os.mkdir(cg_root + cg)
            Path(cg_root + cg, "cgroup.procs").write_text(str(targets[0].pid))
        nproc = sum(1 for _ in procfs.pids())
        resolve = {
            "pid": _ms(lambda: gpufault.Target.process(targets[0].pid).members()),
            "comm": _ms(lambda: gpufault.Target.comm(name).members([str(LIB)])),
            "ranks_of": _ms(lambda: gpufault.Target.ranks_of(os.getpid()).members([str(LIB)])),
        }
        if cg:
            resolve["cgroup"] = _ms(lambda: gpufault.Target.cgroup(cg).members([str(LIB)]))

        def no_container() -> None:
            try:
                gpufault.Target.container("gf-none").members()
            except gpufault.BadInput:
                pass

        resolve["container_scan"] = _ms(no_container)
        arm: dict[int, list[float]] = {n: [] for n in SIZES}
        single: list[float] = []
        disarm: dict[int, list[float]] = {n: [] for n in SIZES}
        spec = gpufault.Fault.fail(str(LIB), "gf_victim", ret=-5, nth=1)
        for _ in range(REPS):
            db = str(tmp / f"gf-{secrets.token_hex(3)}.db")
            t0 = time.perf_counter()
            h = gpufault.arm(spec, targets[0].pid, db=db, duration=60, isolate=True)
            single.append((time.perf_counter() - t0) * 1e3)
            assert [r[3] for r in targets[0].victim(2)] == [-5, 3]
            h.disarm()
            for n in SIZES:
                sel = groups[n]
                t0 = time.perf_counter()
                g = gpufault.arm_all(spec, gpufault.Target.comm(names[n]), db=db, duration=60)
                arm[n].append((time.perf_counter() - t0) * 1e3)
                for t in sel:
                    assert [r[3] for r in t.victim(2)] == [-5, 3]
                t1 = time.perf_counter()
                g.disarm()
                disarm[n].append((time.perf_counter() - t1) * 1e3)
        base = statistics.median(single)
        doc = {
            "bench": "select",
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "processes": nproc,
            "reps": REPS,
            "resolve_ms": resolve,
            "arm_single_pid_ms": round(base, 1),
            "arm_group_ms": {n: round(statistics.median(v), 1) for n, v in arm.items()},
            "arm_group_ratio": {n: round(statistics.median(v) / base, 2) for n, v in arm.items()},
            "disarm_group_ms": {n: round(statistics.median(v), 1) for n, v in disarm.items()},
        }
        print(json.dumps(doc, indent=2))
        return 0
    finally:
        for t in targets + [t for g in groups.values() for t in g]:
            t.close()
        for p in idle:
            p.kill()
            p.wait()
        if cg and cg_root:
            os.rmdir(cg_root + cg)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


if __name__ == "__main__":
    raise SystemExit(main())
