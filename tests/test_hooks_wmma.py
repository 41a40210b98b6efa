"""The WMMA bit-flip kernel's host side and reference, and gpu_check's
behaviour without a GPU. The kernel itself runs on the GPU machine
(python -m pyctl.hooks.gpu_check); nothing here pretends to run it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyctl.hooks import wmma_flip

REPO = Path(__file__).resolve().parent.parent


def test_threshold() -> None:
    assert wmma_flip.threshold(0.0) == 0
    assert wmma_flip.threshold(1.0) == 1 << 32
    assert wmma_flip.threshold(0.5) == 1 << 31
    with pytest.raises(wmma_flip.WmmaError):
        wmma_flip.threshold(1.5)


def test_reference_flips_exactly_the_flagged_elements() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((32, 16)).astype(np.float16)
    b = rng.standard_normal((16, 48)).astype(np.float16)
    flags = np.zeros((32, 48), dtype=np.float32)
    flags[3, 5] = flags[31, 0] = 1.0
    exact = a.astype(np.float32) @ b.astype(np.float32)
    ref = wmma_flip.reference(a, b, flags, 0x80000000)
    assert ref[3, 5] == -exact[3, 5] and ref[31, 0] == -exact[31, 0]
    assert np.count_nonzero(ref != exact) == 2
    np.testing.assert_array_equal(wmma_flip.unflip(ref, flags, 0x80000000), exact)
    # An exponent bit: 0x40000000 turns 1.0f into 2^128 = inf.
    one = np.ones((1,), dtype=np.float32)
    assert np.isinf(wmma_flip.flip_f32(one, 0x40000000)[0])


@pytest.mark.parametrize(
    "sa, sb", [((16, 16), (32, 16)), ((20, 16), (16, 16)), ((16, 16, 1), (16, 16))]
)
def test_shape_errors(sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    with pytest.raises(wmma_flip.WmmaError):
        wmma_flip.check_shapes(np.zeros(sa), np.zeros(sb))


def test_kernel_flips_after_the_last_mma_sync() -> None:
    src = wmma_flip.KERNEL_SRC
    assert f"void {wmma_flip.KERNEL_NAME}(" in src
    assert src.index("mma_sync(acc") < src.index("^ mask") < src.index("store_matrix_sync(C")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
def test_run_without_cupy_is_a_one_line_error() -> None:
    a = np.zeros((16, 16), dtype=np.float16)
    with pytest.raises(wmma_flip.WmmaError, match="cupy is not installed"):
        wmma_flip.run(a, a, 0x80000000, 0.1, 1)


def test_gpu_check_reports_every_check_without_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    p = subprocess.run(
        [sys.executable, "-m", "pyctl.hooks.gpu_check", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    res = json.loads(out.read_text())
    if res["ok"]:
        pytest.skip("a GPU is present and every check passed")
    assert p.returncode == 1
    assert set(res) == {"vram_pressure", "torch_perturbation", "wmma_flip", "ok"}
    assert all(
        not res[k]["ok"] and res[k].get("error")
        for k in ("vram_pressure", "torch_perturbation", "wmma_flip")
    )


def test_ptx_c_layout_covers_the_tile_once() -> None:
    # 32 lanes x 4 registers = the 16x8 f32 tile, each element exactly once:
    # the PTX kernel stores C and the flag matrix through this mapping.
    seen = [p for lane in range(32) for p in wmma_flip.ptx_c_positions(lane)]
    assert sorted(seen) == [(r, c) for r in range(16) for c in range(8)]


def test_ptx_kernel_flips_after_the_last_mma() -> None:
    src = wmma_flip.PTX_KERNEL_SRC
    assert f"void {wmma_flip.PTX_KERNEL_NAME}(" in src
    assert "#include" not in src  # runs where NVRTC has no toolkit headers
    assert src.index("mma.sync.aligned.m16n8k16") < src.index("^ mask") < src.index("C[row")


def test_find_mma_include_needs_crt_mma_h(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "cuda"))
    inc = tmp_path / "nvidia" / "cu13" / "include"
    inc.mkdir(parents=True)
    cands = wmma_flip.mma_include_candidates()
    assert cands[0] == str(tmp_path / "cuda" / "include") and str(inc) in cands
    cands = [c for c in cands if c.startswith(str(tmp_path))]  # not this host's toolkit
    (inc / "mma.h").write_text("")  # what the cu13 wheel has: no crt/mma.h
    assert wmma_flip.find_mma_include(cands) is None
    (inc / "crt").mkdir()
    (inc / "crt" / "mma.h").write_text("")
    assert wmma_flip.find_mma_include(cands) == str(inc)
