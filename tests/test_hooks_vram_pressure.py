"""vram_pressure's logic on the CPU. There is no GPU here: HostMemoryDouble
is a TEST DOUBLE (host memory, a made-up device size) standing in for the
GPU allocator and NVML. The real GPU path runs in pyctl/hooks/gpu_check.py on the
GPU machine."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pyctl.hooks.vram_pressure import (
    MIB,
    HostMemoryDouble,
    PressureError,
    StopEvent,
    acquire,
    plan,
    run,
)

REPO = Path(__file__).resolve().parent.parent


def test_plan_takes_a_share_of_free_in_chunks() -> None:
    assert plan(1000 * MIB, 0.5, 256 * MIB) == [256 * MIB, 244 * MIB]
    assert plan(1000 * MIB, 1.0, 500 * MIB) == [500 * MIB, 500 * MIB]
    assert plan(1000 * MIB, 0.5, 256 * MIB, reserve=600 * MIB) == []
    assert sum(plan(12345, 0.3, 100)) == int(12345 * 0.3)


@pytest.mark.parametrize("share", [0, -0.1, 1.5])
def test_plan_rejects_bad_shares(share: float) -> None:
    with pytest.raises(PressureError, match="share"):
        plan(100, share, 10)


def test_acquire_holds_less_when_chunks_are_refused() -> None:
    dev = HostMemoryDouble(total=100 * MIB, others=0)
    sizes = plan(100 * MIB, 1.0, 30 * MIB)  # 30+30+30+10 fits exactly
    dev.others = 25 * MIB  # someone took memory after sizing
    h = acquire(dev, sizes)
    assert h.bytes_held == 70 * MIB and h.refused == 1 and h.requested == 100 * MIB
    dev.release(h.handles)
    assert dev.held == 0


def test_fill_splits_refused_chunks_down_to_the_last_pieces() -> None:
    from pyctl.hooks.vram_pressure import FILL_MIN

    dev = HostMemoryDouble(total=100 * MIB, others=0)
    sizes = plan(100 * MIB, 1.0, 32 * MIB)  # 32+32+32+4
    dev.others = 25 * MIB  # 75 MiB are left: not a multiple of 32
    h = acquire(dev, sizes, fill=True)
    # 32+32, then halves of the refused chunks: all but < FILL_MIN taken.
    assert 75 * MIB - FILL_MIN < h.bytes_held <= 75 * MIB, h.bytes_held / MIB
    assert h.refused > 1 and h.requested == 100 * MIB
    dev.release(h.handles)
    assert dev.held == 0
    # Without fill the same refusals only shorten the hold.
    dev.others = 25 * MIB
    h = acquire(dev, sizes)
    assert h.bytes_held == 64 * MIB + 4 * MIB, h.bytes_held / MIB
    dev.release(h.handles)


def test_run_holds_until_deadline_and_releases() -> None:
    dev = HostMemoryDouble(total=64 * MIB, others=16 * MIB)
    recs: list[dict[str, Any]] = []
    seen_while_holding: list[int] = []

    def emit(r: dict[str, Any]) -> None:
        recs.append(r)
        if r["event"] == "holding":
            seen_while_holding.append(dev.held)

    # A fake clock that jumps past the deadline after the first reading:
    # the hold ends without waiting 5 s of real time.
    ticks = itertools.chain([100.0], itertools.repeat(105.0))
    rel = run(dev, dev, 0.5, 5.0, threading.Event(), emit, chunk=8 * MIB, clock=lambda: next(ticks))
    hold = recs[0]
    assert hold["bytes_held"] == 24 * MIB == seen_while_holding[0]
    assert hold["nvml_used_after"] - hold["nvml_used_before"] == 24 * MIB
    assert hold["verified"] is True
    assert rel["reason"] == "deadline" and rel["bytes_released"] == 24 * MIB
    assert rel["held_s"] == 5.0
    assert rel["nvml_used_after_release"] == 16 * MIB and dev.held == 0


def test_run_releases_when_stopped() -> None:
    dev = HostMemoryDouble(total=64 * MIB)
    stop = StopEvent()
    holding = threading.Event()
    recs: list[dict[str, Any]] = []

    def emit(r: dict[str, Any]) -> None:
        recs.append(r)
        if r["event"] == "holding":
            holding.set()

    th = threading.Thread(target=run, args=(dev, dev, 0.25, 600.0, stop, emit, 4 * MIB))
    th.start()
    assert holding.wait(10)
    assert dev.held == 16 * MIB
    stop.reason = "signal:SIGTERM"
    stop.set()
    th.join(10)
    assert not th.is_alive()
    assert recs[-1]["reason"] == "signal:SIGTERM" and dev.held == 0


def test_release_runs_even_if_emit_fails() -> None:
    dev = HostMemoryDouble(total=16 * MIB)

    def emit(_r: dict[str, Any]) -> None:
        raise BrokenPipeError("stdout went away")

    with pytest.raises(BrokenPipeError):
        run(dev, dev, 1.0, 1.0, threading.Event(), emit, 4 * MIB)
    assert dev.held == 0


def test_process_releases_on_sigterm() -> None:
    cmd = [
        sys.executable,
        "-m",
        "pyctl.hooks.vram_pressure",
        "--allocator",
        "host-double",
        "--share",
        "0.5",
        "--duration",
        "600",
        "--chunk-mib",
        "16",
    ]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    t0 = time.monotonic()
    hold = json.loads(p.stdout.readline())  # blocks until it holds
    assert hold["event"] == "holding" and hold["bytes_held"] == 128 * MIB
    p.send_signal(signal.SIGTERM)
    rel = json.loads(p.stdout.readline())
    assert p.wait(30) == 0
    assert rel["event"] == "released" and rel["reason"] == "signal:SIGTERM"
    assert time.monotonic() - t0 < 60  # did not wait for the 600 s deadline


def test_process_releases_at_deadline() -> None:
    cmd = [
        sys.executable,
        "-m",
        "pyctl.hooks.vram_pressure",
        "--allocator",
        "host-double",
        "--share",
        "0.1",
        "--duration",
        "0.3",
    ]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    recs = [json.loads(x) for x in out.stdout.splitlines()]
    assert out.returncode == 0
    assert [r["event"] for r in recs] == ["holding", "released"]
    assert recs[1]["reason"] == "deadline" and recs[1]["held_s"] >= 0.3


@pytest.mark.parametrize(
    "args, word",
    [
        (["--share", "2", "--duration", "1", "--allocator", "host-double"], "share"),
        (["--share", "0.5", "--duration", "0", "--allocator", "host-double"], "duration"),
    ],
)
def test_bad_input_one_line_error(args: list[str], word: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pyctl.hooks.vram_pressure", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert word in out.stderr and out.stderr.count("\n") == 1


def test_no_gpu_is_a_clear_one_line_error() -> None:
    # This host has no GPU: the real path must say so in one line.
    out = subprocess.run(
        [sys.executable, "-m", "pyctl.hooks.vram_pressure", "--share", "0.5", "--duration", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode == 0:
        pytest.skip("a GPU is present: the no-GPU error cannot be shown here")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("vram_pressure: ") and out.stderr.count("\n") == 1
