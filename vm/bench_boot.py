#!/usr/bin/env python3
"""Measure boot+run time under TCG for each fetched kernel and report
medians of N runs (default 3) and ratios measured in the same run.

Wall seconds with the default 2 vCPUs: a bare `true`, the host's python3
doing nothing, and python3 with 1 vCPU. Then qemu's CPU seconds (less
disturbed than wall time by other load on the machine) booting `true` with
1 vCPU from the bzImage and from the extracted vmlinux (PVH entry).

  python3 vm/bench_boot.py [-n 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vmrun  # noqa: E402


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def medians(
    kernel: str, argv: list[str], n: int, cpus: int, image: str = "auto"
) -> tuple[float, float]:
    """(median wall seconds, median qemu CPU seconds) of n runs."""
    wall, cpu = [], []
    for _ in range(n):
        c0 = _children_cpu()
        res = vmrun.run_in_vm(kernel, argv, cpus=cpus, timeout=180, image=image)
        if res.rc != 0 or res.error:
            raise SystemExit(f"bench: {kernel} {argv[0]} failed: rc {res.rc} {res.error}")
        wall.append(res.seconds)
        cpu.append(_children_cpu() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=3, help="runs per case (default 3)")
    args = ap.parse_args()
    py = [sys.executable, "-c", "pass"]
    print("wall seconds (medians)")
    print(f"{'kernel':10} {'true':>7} {'python3':>8} {'py 1cpu':>8} {'py/true':>8}")
    rows = []
    for kernel in vmrun.KERNELS:
        why = vmrun.kernel_available(kernel)
        if why:
            print(f"{kernel:10} skipped: {why}")
            continue
        t = medians(kernel, ["true"], args.n, 2)[0]
        p = medians(kernel, py, args.n, 2)[0]
        p1 = medians(kernel, py, args.n, 1)[0]
        print(f"{kernel:10} {t:6.2f}s {p:7.2f}s {p1:7.2f}s {p / t:7.2f}x", flush=True)
        rows.append(kernel)
    print("\nqemu CPU seconds booting `true`, 1 vCPU (medians)")
    print(f"{'kernel':10} {'bzImage':>8} {'vmlinux':>8} {'ratio':>6}")
    for kernel in rows:
        bz = medians(kernel, ["true"], args.n, 1, "vmlinuz")[1]
        pvh = medians(kernel, ["true"], args.n, 1, "vmlinux")[1]
        print(f"{kernel:10} {bz:7.2f}s {pvh:7.2f}s {bz / pvh:5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
