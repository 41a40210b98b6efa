"""GPU validation of the in-process hooks; run on the GPU machine.

    python -m pyctl.hooks.gpu_check [--device 0] [--share 0.3] [--out docs/hooks-gpu.json]

Three checks, each reported even if another fails; prints one JSON object
and exits 0 only if all passed:

- vram_pressure: a real child process holds a share of free memory with
  cupy/torch; NVML (read here, independently of the child) must show the
  used memory rise by what the child says it holds, and fall back after
  SIGTERM;
- torch perturbation on CUDA: the tiny transformer in fp16 on the GPU
  (Tensor Core matmuls), bit-flip divergence table, determinism by seed;
- WMMA kernel: rate 0 equals the fp32 reference; with flips, undoing them
  (flag matrix) gives the reference back; same seed, same flips.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from pyctl.paths import module_argv


def _nvml_used(device: int) -> int:
    # lazy: pynvml is optional (the gpu extra), needed only on a GPU host
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(device)
    return int(pynvml.nvmlDeviceGetMemoryInfo(h).used)


def check_vram(device: int, share: float) -> dict[str, Any]:
    args = ["--share", str(share), "--duration", "120", "--device", str(device)]
    cmd = module_argv("pyctl.hooks.vram_pressure", args)
    before = _nvml_used(device)
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stderr is not None
    line = p.stdout.readline()
    if not line:
        p.wait(30)
        raise RuntimeError(f"vram_pressure exited {p.returncode}: {p.stderr.read().strip()}")
    hold = json.loads(line)
    hold_s = time.monotonic() - t0
    during = _nvml_used(device)
    p.send_signal(signal.SIGTERM)
    rel = json.loads(p.stdout.readline())
    rc = p.wait(60)
    after = _nvml_used(device)
    held = hold["bytes_held"]
    # The child's own CUDA context costs a few hundred MiB on top of what it holds.
    ok = (
        rc == 0
        and hold["verified"]
        and during - before >= 0.9 * held
        and after - before < 0.1 * held + 64 * 2**20
        and rel["reason"] == "signal:SIGTERM"
    )
    return {
        "ok": bool(ok),
        "holding": hold,
        "released": rel,
        "nvml_used_before": before,
        "nvml_used_during": during,
        "nvml_used_after": after,
        "seconds_to_hold": hold_s,
    }


def check_torch(device: int) -> dict[str, Any]:
    # lazy: torch (seconds to import) only where it is used
    import torch

    # lazy: pyctl.hooks.tc_measure imports torch (seconds to import) only where it is used
    from pyctl.hooks import tc_measure

    dev = f"cuda:{device}"
    bits = ["sign", "exp:4", "exp:3", "exp:0", "mant:9", "mant:5", "mant:0"]
    rows = tc_measure.measure("fp16", None, 1e-3, seed=0, device=dev, matmul=True, bits=bits)
    again = tc_measure.measure("fp16", None, 1e-3, seed=0, device=dev, matmul=True, bits=bits)
    by = {r.bits: r for r in rows}
    deterministic = [asdict(r) for r in rows] == [asdict(r) for r in again]
    ok = (
        deterministic
        and by["exp:4"].nonfinite > 0
        and by["mant:0"].top1_agree >= 0.99
        and by["mant:0"].logit_err_mean < by["exp:3"].logit_err_mean
    )
    return {
        "ok": bool(ok),
        "device_name": torch.cuda.get_device_name(device),
        "deterministic": deterministic,
        "rows": [asdict(r) for r in rows],
        "table": tc_measure.table(rows),
    }


def check_wmma(device: int) -> dict[str, Any]:
    """Both back ends where they can run: `ptx` must pass; `wmma` needs the
    toolkit's crt/mma.h, and its absence is reported, not failed."""
    # lazy: pyctl.hooks.wmma_flip (glob, +3 modules) only when this runs
    from pyctl.hooks import wmma_flip

    res: dict[str, Any] = {"mma_include": wmma_flip.find_mma_include()}
    for backend in ("ptx", "wmma"):
        if backend == "wmma" and res["mma_include"] is None:
            res[backend] = {"ok": None, "skipped": "crt/mma.h not found (CUDA pip wheels lack it)"}
            continue
        res[backend] = _guard(lambda b=backend: _check_wmma_backend(device, b))  # type: ignore[misc]
    res["ok"] = bool(res["ptx"]["ok"]) and res["wmma"]["ok"] is not False
    if not res["ok"]:
        res["error"] = res["ptx"].get("error") or res["wmma"].get("error")
    return res


def _check_wmma_backend(device: int, backend: str) -> dict[str, Any]:
    # lazy: cupy is optional (the gpu extra), needed only on a GPU host
    import cupy as cp

    # lazy: pyctl.hooks.wmma_flip (glob, +3 modules) only when this runs
    from pyctl.hooks import wmma_flip

    cp.cuda.Device(device).use()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((128, 64)).astype(np.float16)
    b = rng.standard_normal((64, 96)).astype(np.float16)
    exact = a.astype(np.float32) @ b.astype(np.float32)

    def run(mask: int, rate: float, seed: int) -> Any:
        return wmma_flip.run(a, b, mask=mask, rate=rate, seed=seed, backend=backend)

    clean = run(0x80000000, 0.0, 1)
    sign = run(0x80000000, 0.05, 1)
    same = run(0x80000000, 0.05, 1)
    exp = run(0x40000000, 0.01, 2)
    tol: dict[str, Any] = {"rtol": 1e-3, "atol": 1e-3}
    n = exact.size
    ok_clean = clean.flips == 0 and np.allclose(clean.c, exact, **tol)
    ok_sign = (
        np.allclose(wmma_flip.unflip(sign.c, sign.flags, 0x80000000), exact, **tol)
        and int(sign.flags.sum()) == sign.flips
        and 0.02 * n < sign.flips < 0.08 * n
        and np.allclose(sign.c, wmma_flip.reference(a, b, sign.flags, 0x80000000), **tol)
    )
    ok_same = np.array_equal(sign.c, same.c) and np.array_equal(sign.flags, same.flags)
    ok_exp = np.allclose(wmma_flip.unflip(exp.c, exp.flags, 0x40000000), exact, **tol)
    return {
        "ok": bool(ok_clean and ok_sign and ok_same and ok_exp),
        "backend": clean.backend,
        "clean": bool(ok_clean),
        "sign_flips": sign.flips,
        "elements": n,
        "sign_ok": bool(ok_sign),
        "deterministic": bool(ok_same),
        "exp_flips": exp.flips,
        "exp_ok": bool(ok_exp),
        "exp_nonfinite": int(np.count_nonzero(~np.isfinite(exp.c))),
        "max_abs_err_clean": float(np.abs(clean.c - exact).max()),
    }


def _guard(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:  # every check is reported, whatever the others do
        return {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "trace": traceback.format_exc(limit=4),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--share", type=float, default=0.3)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    res: dict[str, Any] = {
        "vram_pressure": _guard(lambda: check_vram(a.device, a.share)),
        "torch_perturbation": _guard(lambda: check_torch(a.device)),
        "wmma_flip": _guard(lambda: check_wmma(a.device)),
    }
    res["ok"] = all(v["ok"] for v in res.values() if isinstance(v, dict))
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
