"""The reference service on real CUDA (the GPU host); skipped without a GPU.

Here only the refusal is checked: `--device cuda` without CUDA exits 1 with
one line saying what to use instead.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from service_proc import ServiceProc, sample


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


@pytest.mark.skipif(_cuda(), reason="this machine has CUDA")
def test_cuda_mode_without_a_gpu_says_what_to_use() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pyctl.service", "--device", "cuda", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    assert "--device cpu-double" in r.stderr and "no CUDA device" in r.stderr
    assert "serving on" not in r.stderr


@pytest.mark.skipif(not _cuda(), reason="requires a CUDA GPU (torch.cuda.is_available())")
def test_cuda_mode_serves_and_reports_gpu_memory() -> None:
    s = ServiceProc("--device", "cuda", "--batch-wait", "0")
    try:
        st, body = s.complete("on the GPU", 8)
        assert st == 200 and body["degraded"] is False
        assert body["usage"]["completion_tokens"] == 8
        st, h = s.health()
        assert h["status"] == "ok" and h["device"] == "cuda" and not h["libcuda_test_double"]
        sm = s.metric_samples()
        assert sample(sm, "gf_service_gpu_memory_used_bytes", kind="allocated") > 0
        assert sample(sm, "gf_service_gpu_memory_used_bytes", kind="device_used") > 0
    finally:
        assert s.close() == 0, s.stderr()
