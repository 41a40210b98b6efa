"""Hold a share of FREE GPU memory for a while (fault class 2, pressure mode).

    python -m pyctl.hooks.vram_pressure --share 0.5 --duration 30 [--device 0]

Runs as its own process: sizes the hold from NVML's free bytes, allocates
it in chunks (cupy if importable, else torch), checks with NVML that the
device's used memory went up by what it holds, prints a JSON line, holds
until the deadline or SIGINT/SIGTERM, releases, prints a second JSON line:

    {"event": "holding", "bytes_held": ..., "nvml_used_before": ..., ...}
    {"event": "released", "reason": "deadline", "held_s": ..., ...}

The logic (sizing, deadline, signals, release) takes an Allocator and a
MemoryProbe, so it runs without a GPU against HostMemoryDouble, a TEST
DOUBLE that allocates host memory and reports a made-up device
(`--allocator host-double`, for tests only).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pyctl.exceptions import GpufaultError

MIB = 1 << 20


class PressureError(RuntimeError, GpufaultError):
    """One line that says what to do."""


class Allocator(Protocol):
    name: str

    def alloc(self, nbytes: int) -> Any:
        """Allocate nbytes on the device; raise MemoryError when it cannot."""

    def release(self, handles: list[Any]) -> None:
        """Free everything and hand it back to the driver."""


class MemoryProbe(Protocol):
    def info(self) -> tuple[int, int, int]:
        """(used, free, total) bytes of the device, as the driver sees them."""


# ---------------------------------------------------------------- sizing


def plan(free: int, share: float, chunk: int, reserve: int = 0) -> list[int]:
    """Chunk sizes adding up to share * free (minus a reserve left free).

    Chunks rather than one block: a fragmented device may refuse one large
    allocation and accept several smaller ones, and a refused chunk only
    shortens the hold instead of failing it.
    """
    if not 0 < share <= 1:
        raise PressureError(f"share {share} must be in (0, 1]: e.g. --share 0.5")
    if chunk <= 0:
        raise PressureError("chunk must be > 0 MiB")
    target = max(0, int(free * share) - reserve)
    sizes = [chunk] * (target // chunk)
    if target % chunk:
        sizes.append(target % chunk)
    return sizes


@dataclass
class Hold:
    handles: list[Any]
    bytes_held: int
    requested: int
    refused: int  # chunks the allocator refused
    grabbed: int = 0  # bytes taken during the hold (--fill): what others freed


FILL_MIN = 2 * MIB  # the smallest piece --fill tries (the driver's page granularity)
FILL_POLL_S = 0.002  # --fill: how often the hold tries to take what others freed


def acquire(alloc: Allocator, sizes: list[int], fill: bool = False) -> Hold:
    """Allocate the chunks; a refused one is skipped (someone else took
    memory between sizing and now: hold less), or with `fill` split in
    halves down to FILL_MIN and tried again, so that share 1.0 leaves the
    device with less than FILL_MIN free (a neighbour that takes it all)."""
    handles, held, refused = [], 0, 0
    todo = list(reversed(sizes))
    while todo:
        n = todo.pop()
        try:
            handles.append(alloc.alloc(n))
            held += n
        except MemoryError:
            refused += 1
            if fill and n // 2 >= FILL_MIN:
                todo += [n - n // 2, n // 2]
    return Hold(handles, held, sum(sizes), refused)


# ---------------------------------------------------------------- run


def run(
    alloc: Allocator,
    probe: MemoryProbe,
    share: float,
    duration_s: float,
    stop: threading.Event,
    emit: Callable[[dict[str, Any]], None],
    chunk: int = 256 * MIB,
    reserve: int = 0,
    device: int = 0,
    clock: Callable[[], float] = time.monotonic,
    fill: bool = False,
) -> dict[str, Any]:
    """Size, take, verify, hold until deadline or `stop`, release. Returns the release record."""
    if duration_s <= 0:
        raise PressureError(f"duration {duration_s} must be > 0 s: e.g. --duration 30")
    used0, free0, total = probe.info()
    sizes = plan(free0, share, chunk, reserve)
    t0 = clock()
    deadline = t0 + duration_s
    hold = acquire(alloc, sizes, fill)
    try:
        used1, free1, _ = probe.info()
        grew = used1 - used0
        emit(
            {
                "event": "holding",
                "pid": os.getpid(),
                "device": device,
                "allocator": alloc.name,
                "share": share,
                "bytes_requested": hold.requested,
                "bytes_held": hold.bytes_held,
                "chunks": len(hold.handles),
                "chunks_refused": hold.refused,
                "nvml_total": total,
                "nvml_used_before": used0,
                "nvml_used_after": used1,
                "nvml_free_before": free0,
                "nvml_free_after": free1,
                # Other processes move NVML too; 90 % of what we hold is the bar.
                "verified": grew >= 0.9 * hold.bytes_held,
                "deadline_s": duration_s,
            }
        )
        if fill:
            # A hog: what others free during the hold is taken too, in
            # FILL_MIN pieces (a service that frees and re-allocates its
            # working set between batches otherwise keeps fitting into its
            # own hole: runs 23-26 on the H200). Polled: there is no event for
            # "memory was freed".
            while not stop.wait(FILL_POLL_S) and clock() < deadline:
                try:
                    hold.handles.append(alloc.alloc(FILL_MIN))
                    hold.bytes_held += FILL_MIN
                    hold.grabbed += FILL_MIN
                except MemoryError:
                    pass
        # Wait on the event, bounded by the deadline: a signal sets it. In
        # slices: a signal that lands after the interpreter's last check and
        # before the thread blocks runs its handler only when the wait ends
        # (once seen in CI: SIGTERM released at the 600 s deadline).
        while not stop.wait(timeout=min(WAIT_SLICE_S, max(0.0, deadline - clock()))):
            if clock() >= deadline:
                break
        reason = getattr(stop, "reason", "signal") if stop.is_set() else "deadline"
    finally:
        alloc.release(hold.handles)
    used2, free2, _ = probe.info()
    rec = {
        "event": "released",
        "pid": os.getpid(),
        "device": device,
        "reason": reason,
        "held_s": round(clock() - t0, 3),
        "bytes_released": hold.bytes_held,
        "bytes_grabbed_during_hold": hold.grabbed,
        "nvml_used_after_release": used2,
        "nvml_free_after_release": free2,
    }
    emit(rec)
    return rec


# The longest a missed signal can wait for its handler (see run()).
WAIT_SLICE_S = 0.2


class StopEvent(threading.Event):
    """An Event that remembers which signal set it."""

    reason = "signal"

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signo: int, _frame: Any) -> None:
        self.reason = f"signal:{signal.Signals(signo).name}"
        self.set()


# ---------------------------------------------------------------- back ends


class NvmlProbe:
    """Used/free/total of one device from NVML (nvidia-ml-py)."""

    def __init__(self, device: int) -> None:
        try:
            # lazy: pynvml is optional (the gpu extra), needed only on a GPU host
            import pynvml
        except ImportError:
            raise PressureError(
                "NVML bindings missing: pip install nvidia-ml-py (needs an NVIDIA driver)"
            ) from None
        try:
            pynvml.nvmlInit()
            self._h = pynvml.nvmlDeviceGetHandleByIndex(device)
        except pynvml.NVMLError as e:
            raise PressureError(
                f"no GPU through NVML ({e}): run on a host with an NVIDIA GPU and driver"
            ) from None
        self._nvml = pynvml

    def info(self) -> tuple[int, int, int]:
        m = self._nvml.nvmlDeviceGetMemoryInfo(self._h)
        return int(m.used), int(m.free), int(m.total)


class CupyAllocator:
    name = "cupy"

    def __init__(self, device: int) -> None:
        # lazy: cupy is optional (the gpu extra), needed only on a GPU host
        import cupy

        self._cp = cupy
        cupy.cuda.Device(device).use()

    def alloc(self, nbytes: int) -> Any:
        try:
            # Raw cudaMalloc, not the pool: release must reach the driver.
            return self._cp.cuda.Memory(nbytes)
        except self._cp.cuda.memory.OutOfMemoryError as e:
            raise MemoryError(str(e)) from None
        except self._cp.cuda.runtime.CUDARuntimeError as e:
            raise MemoryError(str(e)) from None

    def release(self, handles: list[Any]) -> None:
        handles.clear()  # Memory frees on the last reference
        self._cp.cuda.Device().synchronize()


class TorchAllocator:
    name = "torch"

    def __init__(self, device: int) -> None:
        # lazy: torch (seconds to import) only where it is used
        import torch

        if not torch.cuda.is_available():
            raise PressureError("torch sees no CUDA device: install a CUDA build of torch or cupy")
        self._torch = torch
        self._dev = torch.device("cuda", device)

    def alloc(self, nbytes: int) -> Any:
        try:
            return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self._dev)
        except self._torch.cuda.OutOfMemoryError as e:
            raise MemoryError(str(e)) from None

    def release(self, handles: list[Any]) -> None:
        handles.clear()
        # The caching allocator keeps freed blocks: give them back to the driver.
        self._torch.cuda.empty_cache()
        self._torch.cuda.synchronize(self._dev)


def gpu_allocator(device: int, prefer: str = "auto") -> Allocator:
    if prefer in ("auto", "cupy"):
        try:
            return CupyAllocator(device)
        except ImportError:
            if prefer == "cupy":
                raise PressureError("cupy is not installed: pip install cupy-cuda12x") from None
    try:
        return TorchAllocator(device)
    except ImportError:
        raise PressureError(
            "neither cupy nor torch is importable: pip install cupy-cuda12x"
        ) from None


class HostMemoryDouble:
    """TEST DOUBLE: a made-up device of `total` bytes backed by host memory.

    Implements both Allocator and MemoryProbe; `others` bytes are "used by
    other processes". Not a GPU: for testing the logic without one.
    """

    name = "host-double"

    def __init__(self, total: int, others: int = 0) -> None:
        self.total, self.others, self.held = total, others, 0
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> Any:
        with self._lock:
            if self.others + self.held + nbytes > self.total:
                raise MemoryError("host double: out of made-up device memory")
            self.held += nbytes
        buf = bytearray(nbytes)  # real host memory, zero-filled (touched)
        return buf

    def release(self, handles: list[Any]) -> None:
        with self._lock:
            self.held -= sum(len(h) for h in handles)
        handles.clear()

    def info(self) -> tuple[int, int, int]:
        used = self.others + self.held
        return used, self.total - used, self.total


# ---------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vram_pressure", description=__doc__.split("\n\n")[0])
    ap.add_argument("--share", type=float, required=True, help="share of FREE memory, 0..1")
    ap.add_argument("--duration", type=float, required=True, help="seconds to hold")
    ap.add_argument("--device", type=int, default=0, help="NVML/CUDA device index")
    ap.add_argument("--chunk-mib", type=int, default=256)
    ap.add_argument("--reserve-mib", type=int, default=0, help="leave this much free")
    ap.add_argument(
        "--fill",
        action="store_true",
        help="split a refused chunk down to 2 MiB and try again, and take what others free "
        "during the hold (share 1.0: a neighbour that leaves ~nothing free)",
    )
    ap.add_argument("--allocator", default="auto", choices=["auto", "cupy", "torch", "host-double"])
    ap.add_argument("--double-total-mib", type=int, default=256, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    stop = StopEvent()
    stop.install()

    def emit(rec: dict[str, Any]) -> None:
        print(json.dumps(rec), flush=True)

    try:
        if a.allocator == "host-double":
            dbl = HostMemoryDouble(a.double_total_mib * MIB)
            alloc: Allocator = dbl
            probe: MemoryProbe = dbl
        else:
            probe = NvmlProbe(a.device)
            alloc = gpu_allocator(a.device, a.allocator)
        run(
            alloc,
            probe,
            a.share,
            a.duration,
            stop,
            emit,
            a.chunk_mib * MIB,
            a.reserve_mib * MIB,
            a.device,
            fill=a.fill,
        )
    except PressureError as e:
        print(f"vram_pressure: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
