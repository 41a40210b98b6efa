"""The device-check harness on this machine, without a GPU: arming an
engine from a polling thread against the libcuda TEST DOUBLE's workload
(pyctl/data/doubles/gf-infer), and the two-rank all-reduce protocol over
torch.distributed's gloo backend (CPU; the device run uses NCCL)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pyctl import paths  # noqa: E402
from tests.device import checks as C  # noqa: E402

INFER = paths.DOUBLE_INFER


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="requires root (BPF, ptrace)")
@pytest.mark.skipif(not INFER.exists(), reason=paths.hint(INFER))
def test_armed_engine_from_a_polling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyctl.copilot import block_sigchld

    block_sigchld()
    monkeypatch.setattr(C, "WORK", tmp_path)
    # --steps 0: run until stdin closes. gf-infer prints a line per failed
    # CUDA call: the injected launch failure is the event awaited.
    p = subprocess.Popen(
        [str(INFER), "--threads", "1", "--steps", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    db = tmp_path / "h.db"
    lib = str(INFER.parent / "libcuda.so.1")  # by path: no race with the loader's maps
    seen = ""
    try:
        specs = [
            C.tspec(lib=lib, fn="cuMemAlloc_v2", trace=True),
            C.tspec(lib=lib, fn="cuLaunchKernel", action="fail", ret=719, nth=3),
        ]
        with C.armed(specs, p.pid, db) as eng:
            ready, _, _ = select.select([p.stdout], [], [], 60)
            seen = p.stdout.readline() if ready else ""
            rid = eng.run_id
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(30)
    assert "cuLaunchKernel -> CUDA_ERROR_LAUNCH_FAILED (719)" in seen
    assert C.POLL_ERRORS == []
    # Both specs are armed at one moment (after the copilot holds the
    # threads), possibly between a step's alloc and its launch: the 3rd
    # launch comes after at least 2 traced allocs.
    assert C.calls_by_symbol(db, rid)["cuMemAlloc_v2"] >= 2
    [f] = C.faults_of(db, rid)
    assert (f["function"], f["retval"], f["call_seq"]) == ("cuLaunchKernel", 719, 3)


def test_two_rank_protocol_over_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch.distributed")
    monkeypatch.setenv("GF_NCCL_BACKEND", "gloo")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setattr(C, "WORK", tmp_path)
    r = C._nccl_round(tmp_path, "gloo", None, 30, timeout_s=30)
    assert "error" not in r and r["rc"] == [0, 0], r
    assert [x["iterations"] for x in r["rank"]] == [30, 30]
    assert all(x["sum_ok"] and x["p99_ms"] >= x["p50_ms"] > 0 for x in r["rank"])
