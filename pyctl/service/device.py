"""Where a batch runs, and what counts as a device error there.

Three backends with one interface: `open()` in the worker thread (CUDA
contexts are per thread), `run_batch(fn, n_tokens)` which runs the batch's
decoding `fn(on_step)` and turns the backend's failures into DeviceError,
and `memory()` for the GPU-memory gauge.

- cpu: plain torch on the CPU; there are no device errors.
- cuda: torch on the GPU host; torch.cuda.OutOfMemoryError and CUDA
  RuntimeErrors (torch.AcceleratorError) are device errors.
- cpu-double: torch on the CPU, and each batch also goes through the
  libcuda TEST DOUBLE: cuMemAlloc_v2 of the batch's activation size, per
  generated token a gf_fill cuLaunchKernel and cuCtxSynchronize, then
  cuMemFree_v2. A failed call (for example one gpufault made fail) is the
  batch's device error, named by its CUresult.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol, TypeVar

from pyctl.service.double import CudaCallError, DoubleDriver

T = TypeVar("T")
StepHook = Callable[[int], None]


class DeviceError(Exception):
    """A batch failed on its device. `code` names the error (a CUresult
    name where there is one), `call` the failing call when known."""

    def __init__(self, code: str, message: str, call: str = "") -> None:
        super().__init__(message)
        self.code, self.call = code, call


class Backend(Protocol):
    name: str
    torch_device: str
    double: bool  # True where the batch goes through the libcuda TEST DOUBLE

    def open(self) -> None: ...
    def close(self) -> None: ...
    def run_batch(self, fn: Callable[[StepHook | None], T], n_tokens: int) -> T: ...
    def memory(self) -> dict[str, float]: ...


class CpuBackend:
    name = "cpu"
    torch_device = "cpu"
    double = False

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def run_batch(self, fn: Callable[[StepHook | None], T], n_tokens: int) -> T:
        return fn(None)

    def memory(self) -> dict[str, float]:
        return {}


# cudaGetErrorString texts (what torch puts after "CUDA error: ") -> CUresult names.
_CUDA_TEXTS = {
    "out of memory": "CUDA_ERROR_OUT_OF_MEMORY",
    "an illegal memory access was encountered": "CUDA_ERROR_ILLEGAL_ADDRESS",
    "unspecified launch failure": "CUDA_ERROR_LAUNCH_FAILED",
    "device-side assert triggered": "CUDA_ERROR_ASSERT",
    "the launch timed out and was terminated": "CUDA_ERROR_LAUNCH_TIMEOUT",
    "too many resources requested for launch": "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
    "an illegal instruction was encountered": "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "misaligned address": "CUDA_ERROR_MISALIGNED_ADDRESS",
    "invalid argument": "CUDA_ERROR_INVALID_VALUE",
    "initialization error": "CUDA_ERROR_NOT_INITIALIZED",
    "no CUDA-capable device is detected": "CUDA_ERROR_NO_DEVICE",
}
_CUDA_ERR = re.compile(r"CUDA error: ([^\n]+)")


def classify_torch_cuda(exc: BaseException) -> DeviceError | None:
    """A torch exception -> DeviceError, or None when it is not a CUDA error."""
    import torch

    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return DeviceError("CUDA_ERROR_OUT_OF_MEMORY", first)
    accel = getattr(torch, "AcceleratorError", None)
    if isinstance(exc, RuntimeError) and (
        (accel is not None and isinstance(exc, accel)) or "CUDA" in str(exc)
    ):
        m = _CUDA_ERR.search(str(exc))
        text = m.group(1).strip().rstrip(".") if m else ""
        return DeviceError(_CUDA_TEXTS.get(text, "CUDA_ERROR_OTHER"), first)
    return None


class CudaBackend:
    name = "cuda"
    torch_device = "cuda"
    double = False

    def open(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "--device cuda: torch sees no CUDA device here; use --device cpu or "
                "--device cpu-double (the libcuda test double) on machines without a GPU"
            )
        torch.zeros(1, device="cuda")  # the context, in this (the worker) thread

    def close(self) -> None:
        pass

    def run_batch(self, fn: Callable[[StepHook | None], T], n_tokens: int) -> T:
        import torch

        try:
            out = fn(None)
            # Errors of asynchronous kernels surface at a synchronize: make
            # them this batch's, not the next one's.
            torch.cuda.synchronize()
            return out
        except Exception as e:
            err = classify_torch_cuda(e)
            if err is None:
                raise
            raise err from e

    def memory(self) -> dict[str, float]:
        import torch

        # Only once this process has a CUDA context: a scrape must never create one.
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return {}
        try:
            free, total = torch.cuda.mem_get_info()
            return {
                "allocated": float(torch.cuda.memory_allocated()),
                "reserved": float(torch.cuda.memory_reserved()),
                "device_used": float(total - free),
            }
        except Exception:  # a poisoned context: no numbers rather than a failed scrape
            return {}


class DoubleBackend:
    """torch on the CPU plus the libcuda TEST DOUBLE per batch (not real CUDA)."""

    name = "cpu-double"
    torch_device = "cpu"
    double = True

    def __init__(self, bytes_per_token: int, path: str | None = None) -> None:
        self.bytes_per_token = bytes_per_token
        self.path = path
        self.drv: DoubleDriver | None = None
        self.allocated = 0  # bytes this service holds in the double right now

    def open(self) -> None:
        self.drv = DoubleDriver(self.path)
        try:
            self.drv.open()
        except CudaCallError as e:
            raise RuntimeError(f"libcuda test double {self.drv.path}: {e}") from e

    def close(self) -> None:
        if self.drv is not None:
            self.drv.close()

    def run_batch(self, fn: Callable[[StepHook | None], T], n_tokens: int) -> T:
        drv = self.drv
        assert drv is not None, "open() first (in the worker thread)"
        nbytes = max(4096, n_tokens * self.bytes_per_token)
        try:
            drv.reopen_if_poisoned()
            dptr = drv.alloc(nbytes)
        except CudaCallError as e:
            raise DeviceError(e.name, str(e), e.call) from e
        self.allocated = nbytes
        failed: CudaCallError | None = None

        def on_step(step: int) -> None:
            drv.launch_fill(dptr, nbytes, step)
            drv.synchronize()

        try:
            return fn(on_step)
        except CudaCallError as e:
            failed = e
            raise DeviceError(e.name, str(e), e.call) from e
        finally:
            try:
                drv.free(dptr)
            except CudaCallError as e:
                # A failed free fails the batch unless it already failed.
                if failed is None:
                    raise DeviceError(e.name, str(e), e.call) from e
            finally:
                self.allocated = 0

    def memory(self) -> dict[str, float]:
        return {"double_allocated": float(self.allocated)}


def make_backend(device: str, bytes_per_token: int) -> Backend:
    if device == "cpu":
        return CpuBackend()
    if device == "cuda":
        return CudaBackend()
    if device == "cpu-double":
        return DoubleBackend(bytes_per_token)
    raise ValueError(f"unknown device {device!r}")
