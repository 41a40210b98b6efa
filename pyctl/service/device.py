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
  generated token a gf_fill cuLaunchKernel, an 8x8 cublasSgemm_v2 of the
  libcublas TEST DOUBLE and cuCtxSynchronize, then cuMemFree_v2. A failed
  call (for example one gpufault made fail) is the batch's device error,
  named by its CUresult or cuBLAS status.

--cuda-mode (docs/service.md, "CUDA modes") changes how the per-token work
is issued: `graph` replays a captured graph (cuGraphLaunch) per token and
falls back to eager launches for a batch whose replay failed; `managed`
allocates the activations with cuMemAllocManaged and prefetches them
(cuMemPrefetchAsync_v2), ignoring a failed prefetch. Both report what
they did through `on_event(event, code)`: graph_replay, graph_fallback,
prefetch_failed (the service counts them in /metrics).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pyctl.service.double import CublasDouble, CudaCallError, DoubleDriver

T = TypeVar("T")
StepHook = Callable[[int], None]
# (event, CUresult name or ""): graph_replay, graph_fallback, prefetch_failed.
EventHook = Callable[[str, str], None]


def _no_event(event: str, code: str) -> None:
    pass


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
    on_event: EventHook  # the service sets it to count graph fallbacks etc.

    def open(self) -> None: ...
    def close(self) -> None: ...
    def run_batch(self, fn: Callable[[StepHook | None], T], n_tokens: int) -> T: ...
    def memory(self) -> dict[str, float]: ...


class CpuBackend:
    name = "cpu"
    torch_device = "cpu"
    double = False

    def __init__(self) -> None:
        self.on_event: EventHook = _no_event

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
_LIB_STATUS = re.compile(r"((?:CUBLAS|CUFFT|CUSOLVER|CUSPARSE)_[A-Z_]+)(?: when calling `(\w+))?")


def classify_torch_cuda(exc: BaseException) -> DeviceError | None:
    """A torch exception -> DeviceError, or None when it is not a CUDA error."""
    # lazy: torch (seconds to import) only where it is used
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
        # cuBLAS failures come as "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED
        # when calling `cublasLtMatmul(...)`": the status is the code.
        lib = _LIB_STATUS.match(text)
        if lib:
            return DeviceError(lib.group(1), first, lib.group(2) or "")
        return DeviceError(_CUDA_TEXTS.get(text, "CUDA_ERROR_OTHER"), first)
    return None


class CudaBackend:
    name = "cuda"
    torch_device = "cuda"
    double = False

    def __init__(self, scratch_per_token: int = 0) -> None:
        self.on_event: EventHook = _no_event
        # A KV-cache-like tensor per batch (bytes per token of it): a real
        # server's cache grows with its tokens, this model's activations are
        # a few hundred KB, too little to feel a neighbour's VRAM pressure.
        self.scratch_per_token = scratch_per_token

    def open(self) -> None:
        # lazy: torch (seconds to import) only where it is used
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
        # lazy: torch (seconds to import) only where it is used
        import torch

        try:
            scratch = (
                torch.empty(n_tokens * self.scratch_per_token, dtype=torch.uint8, device="cuda")
                if self.scratch_per_token
                else None
            )
            out = fn(None)
            # Errors of asynchronous kernels surface at a synchronize: make
            # them this batch's, not the next one's.
            torch.cuda.synchronize()
            del scratch
            return out
        except Exception as e:
            err = classify_torch_cuda(e)
            if err is None:
                raise
            raise err from e

    def memory(self) -> dict[str, float]:
        # lazy: torch (seconds to import) only where it is used
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


def pad_into(static_ids: Any, static_valid: Any, ids: Any, valid: Any) -> int:
    """Left-pad a step's (B, T) ids and mask into graph mode's static
    (rows, width) tensors; the rest is padding (valid False). Returns B."""
    b, t = ids.shape
    static_ids.zero_()
    static_valid.zero_()
    static_ids[:b, -t:].copy_(ids)
    static_valid[:b, -t:].copy_(valid)
    return int(b)


class CudaGraphStep:
    """--device cuda --cuda-mode graph: the primary model's forward captured
    once with torch.cuda.CUDAGraph and replayed per generated token.

    A graph replays fixed shapes, so it is captured at max_batch rows x
    max_context positions and each step's input is left-padded into its
    static tensors (left padding leaves the answers unchanged: positions
    count only real tokens). A replay that raises (a failed cudaGraphLaunch)
    is counted and the rest of the batch runs the eager forward; the next
    batch replays again. A sticky error fails the eager forward too, and
    CudaBackend.run_batch makes it the batch's device error."""

    def __init__(self, model: Any, rows: int, width: int, on_event: EventHook) -> None:
        # lazy: torch (seconds to import) only where it is used
        import torch

        self.model, self.on_event, self.eager = model, on_event, False
        dev = next(model.parameters()).device
        with torch.inference_mode():
            self.ids = torch.zeros(rows, width, dtype=torch.long, device=dev)
            self.valid = torch.zeros(rows, width, dtype=torch.bool, device=dev)
            side = torch.cuda.Stream()  # warm up off the default stream (torch's recipe)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    model(self.ids, self.valid)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = model(self.ids, self.valid)

    def begin_batch(self) -> None:
        self.eager = False

    def __call__(self, ids: Any, valid: Any) -> Any:
        if self.eager:
            return self.model(ids, valid)
        b = pad_into(self.ids, self.valid, ids, valid)
        try:
            self.graph.replay()
        except RuntimeError as e:
            err = classify_torch_cuda(e)
            self.on_event("graph_fallback", err.code if err else "CUDA_ERROR_OTHER")
            self.eager = True
            return self.model(ids, valid)
        self.on_event("graph_replay", "")
        return self.logits[:b].clone()  # the static output is overwritten by the next replay


@dataclass
class _DoubleGraph:
    """--cuda-mode graph on the double: a static activation buffer (graphs
    bake their pointers in, so it outlives batches) and the per-token graph."""

    dptr: int
    nbytes: int
    exe: int | None  # None: re-capture before the next replay
    generation: int  # the driver's context generation it belongs to


class DoubleBackend:
    """torch on the CPU plus the libcuda TEST DOUBLE per batch (not real CUDA)."""

    name = "cpu-double"
    torch_device = "cpu"
    double = True

    def __init__(
        self,
        bytes_per_token: int,
        path: str | None = None,
        *,
        mode: str = "eager",
        static_bytes: int = 0,
    ) -> None:
        self.bytes_per_token = bytes_per_token
        self.path = path
        self.mode = mode
        # graph mode's static buffer: the activations of a full-context sequence.
        self.static_bytes = max(4096, static_bytes)
        self.drv: DoubleDriver | None = None
        self.blas: CublasDouble | None = None
        self.allocated = 0  # bytes this service holds in the double right now
        self.on_event: EventHook = _no_event
        self._graph: _DoubleGraph | None = None

    def open(self) -> None:
        self.drv = DoubleDriver(self.path)
        try:
            self.drv.open()
        except CudaCallError as e:
            raise RuntimeError(f"libcuda test double {self.drv.path}: {e}") from e
        try:
            self.blas = CublasDouble()
        except CudaCallError as e:
            raise RuntimeError(f"libcublas test double: {e}") from e

    def close(self) -> None:
        if self.blas is not None:
            self.blas.close()
        if self.drv is not None:
            self.drv.close()

    def run_batch(self, fn: Callable[[StepHook | None], T], n_tokens: int) -> T:
        drv = self.drv
        assert drv is not None, "open() first (in the worker thread)"
        try:
            drv.reopen_if_poisoned()
            if self.mode == "graph":
                return self._run_graph(drv, fn, n_tokens)
            return self._run_eager(drv, fn, n_tokens)
        except CudaCallError as e:
            raise DeviceError(e.name, str(e), e.call) from e

    def _run_eager(self, drv: DoubleDriver, fn: Callable[[StepHook | None], T], n: int) -> T:
        """Per batch: alloc (managed: + prefetch), per token launch + sync, free."""
        nbytes = max(4096, n * self.bytes_per_token)
        dptr = drv.alloc_managed(nbytes) if self.mode == "managed" else drv.alloc(nbytes)
        self.allocated = nbytes
        failed = False
        try:
            if self.mode == "managed":
                self._prefetch(drv, dptr, nbytes)

            blas = self.blas
            assert blas is not None

            def on_step(step: int) -> None:
                drv.launch_fill(dptr, nbytes, step)
                blas.sgemm(dptr)  # the token's GEMM: cuBLAS faults (class 8) land here
                drv.synchronize()

            return fn(on_step)
        except CudaCallError:
            failed = True
            raise
        finally:
            try:
                drv.free(dptr)
            except CudaCallError:
                if not failed:  # a failed free fails the batch unless it already failed
                    raise
            finally:
                self.allocated = 0

    def _prefetch(self, drv: DoubleDriver, dptr: int, nbytes: int) -> None:
        try:
            drv.prefetch(dptr, nbytes)
        except CudaCallError as e:
            if drv.poisoned:  # a sticky error: the context is gone, the batch too
                raise
            # A prefetch is a hint: without it the pages migrate on first
            # touch (slower, still correct), so the batch goes on.
            self.on_event("prefetch_failed", e.name)

    def _graph_ready(self, drv: DoubleDriver) -> _DoubleGraph:
        """The graph of the current context, (re-)captured when needed."""
        g = self._graph
        if g is None or g.generation != drv.generation:
            # First batch, or a re-created context: its memory died with the
            # old one (the double keeps old execs apart: free that one).
            if g is not None and g.exe is not None:
                drv.graph_destroy(g.exe)
            self._graph = None
            g = self._graph = _DoubleGraph(
                drv.alloc(self.static_bytes), self.static_bytes, None, drv.generation
            )
        if g.exe is None:
            g.exe = drv.capture_fill_graph(g.dptr, g.nbytes)
        return g

    def _run_graph(self, drv: DoubleDriver, fn: Callable[[StepHook | None], T], n: int) -> T:
        """Per token one cuGraphLaunch; after a failed replay (or capture) the
        rest of the batch runs eager launches, so no request fails for it.
        Sticky errors (a poisoned context) and a failed static allocation
        stay device errors: eager launches could not do better."""
        try:
            g = self._graph_ready(drv)
        except CudaCallError as e:
            if drv.poisoned or self._graph is None:
                raise
            self.on_event("graph_fallback", e.name)
            return self._run_eager(drv, fn, n)
        eager = False

        def on_step(step: int) -> None:
            nonlocal eager
            if not eager and g.exe is not None:
                try:
                    drv.graph_launch(g.exe)
                    self.on_event("graph_replay", "")
                    return
                except CudaCallError as e:
                    if drv.poisoned:
                        raise
                    # Drop the exec (it may be what broke): the next batch
                    # captures a fresh one; this batch goes on eagerly.
                    drv.graph_destroy(g.exe)
                    g.exe, eager = None, True
                    self.on_event("graph_fallback", e.name)
            drv.launch_fill(g.dptr, g.nbytes, step)
            drv.synchronize()

        return fn(on_step)

    def memory(self) -> dict[str, float]:
        held = self._graph.nbytes if self._graph is not None else 0  # graph mode's static buffer
        return {"double_allocated": float(self.allocated + held)}


def make_backend(
    device: str, bytes_per_token: int, *, mode: str = "eager", static_bytes: int = 0
) -> Backend:
    if device == "cpu":
        return CpuBackend()
    if device == "cuda":
        return CudaBackend(bytes_per_token)
    if device == "cpu-double":
        return DoubleBackend(bytes_per_token, mode=mode, static_bytes=static_bytes)
    raise ValueError(f"unknown device {device!r}")
