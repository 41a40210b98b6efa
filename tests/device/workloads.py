"""GPU workloads for the device checks: real torch / cupy / libcuda programs.

Run as `python -m tests.device.workloads NAME [--arg value ...]`. Each one
initializes (CUDA context, libraries mapped), prints `READY {json}` and
waits for a line on stdin, so the controller attaches every probe before
the measured part runs; it then prints `RESULT {json}` lines. A workload
with phases reads one command line per phase until stdin closes.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
import traceback
from typing import Any


def say(tag: str, obj: Any) -> None:
    sys.stdout.write(f"{tag} {json.dumps(obj, default=str)}\n")
    sys.stdout.flush()


def ready(info: dict[str, Any] | None = None) -> str:
    say("READY", {"pid": os.getpid(), **(info or {})})
    return sys.stdin.readline().strip()


def calls(one: Any, n: int) -> dict[str, Any]:
    """Call one() n times like an application that logs and goes on:
    which calls (1-based) raised what, and how many succeeded."""
    out: dict[str, Any] = {"errors": [], "ok_calls": 0}
    for i in range(1, n + 1):
        try:
            one()
            out["ok_calls"] += 1
        except Exception as e:  # noqa: BLE001 - an injected fault, reported
            out["errors"].append([i, err_text(e)])
    return out


def err_text(e: BaseException) -> str:
    return f"{type(e).__module__}.{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


# ---- a small transformer decode loop (random weights, eager) ----------------
def _model(torch: Any, d: int, layers: int, heads: int, vocab: int) -> Any:
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: Any, kc: Any, vc: Any, t: int) -> Any:
            b = x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).view(b, 3, heads, d // heads).unbind(1)
            kc[:, t] = k
            vc[:, t] = v
            att = torch.einsum("bhd,bthd->bht", q, kc[:, : t + 1]) / (d // heads) ** 0.5
            y = torch.einsum("bht,bthd->bhd", att.softmax(-1), vc[:, : t + 1]).reshape(b, d)
            x = x + self.proj(y)
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(d, vocab)

    return LM()


def decode(argv: list[str]) -> None:
    """Phases: `STEPS N [empty_cache] [times]` runs N decode steps (one
    token each, one .item() and one torch.cuda.synchronize() per step) and
    reports tokens/s, the median and p99 step time (and every step time with
    `times`), and the allocator's cudaMalloc count delta. Errors end the
    phase and are reported with the step they happened at."""
    import torch

    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    if "--cpu" in opts:  # one core of its own: the launch loop is CPU-bound
        os.sched_setaffinity(0, {int(opts["--cpu"])})
    d, layers, heads = int(opts.get("--d", 512)), int(opts.get("--layers", 4)), 8
    vocab, batch, maxlen = 4096, int(opts.get("--batch", 4)), 4096
    torch.manual_seed(0)
    dev = torch.device("cuda")
    m = _model(torch, d, layers, heads, vocab).to(dev).eval()
    caches = [
        (
            torch.zeros(batch, maxlen, heads, d // heads, device=dev),
            torch.zeros(batch, maxlen, heads, d // heads, device=dev),
        )
        for _ in range(layers)
    ]
    state = {"t": 0, "tok": torch.zeros(batch, dtype=torch.long, device=dev)}

    @torch.no_grad()
    def step() -> int:
        t = state["t"] % maxlen
        x = m.emb(state["tok"])
        for blk, (kc, vc) in zip(m.blocks, caches, strict=False):
            x = blk(x, kc, vc, t)
        tok = m.head(x).argmax(-1)
        state["tok"] = tok
        state["t"] += 1
        first = int(tok[0].item())  # a decode loop hands each token to the host
        torch.cuda.synchronize()
        return first

    for _ in range(20):  # warm-up: cuBLAS handles, allocator segments
        step()
    # Ground truth for launches per step: the profiler (CUPTI), before any probe.
    kernels = launches = -1
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
        evs = prof.events()
        kernels = sum(
            1
            for e in evs
            if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))
        )
        launches = sum(
            1
            for e in evs
            if e.name.startswith(("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        )
    except Exception as e:  # noqa: BLE001 - report, do not die
        say("NOTE", {"profiler": err_text(e)})
    cmd = ready(
        {
            "kernels_per_10_steps": kernels,
            "launch_calls_per_10_steps": launches,
            "batch": batch,
            "torch": torch.__version__,
        }
    )
    while cmd:
        parts = cmd.split()
        n = int(parts[1])
        if "empty_cache" in parts:
            torch.cuda.empty_cache()
        seg0 = torch.cuda.memory_stats().get("segment.all.allocated", 0)
        times: list[float] = []
        error, t0 = None, time.perf_counter()
        for i in range(n):
            ts = time.perf_counter()
            try:
                step()
            except Exception as e:  # noqa: BLE001 - an injected fault, reported
                error = {"step": i + 1, "error": err_text(e)}
                break
            times.append((time.perf_counter() - ts) * 1e3)
        dt = time.perf_counter() - t0
        seg1 = torch.cuda.memory_stats().get("segment.all.allocated", 0)
        srt = sorted(times) or [0.0]
        res = {
            "steps": len(times),
            "seconds": dt,
            "tokens_per_s": len(times) * batch / dt,
            "steps_per_s": len(times) / dt,
            "segments_allocated": seg1 - seg0,
            "step_ms_median": srt[len(srt) // 2],
            "step_ms_p99": srt[min(len(srt) - 1, int(0.99 * len(srt)))],
            "error": error,
        }
        if "times" in parts:
            res["step_ms"] = [round(x, 3) for x in times]
        say("RESULT", res)
        if error is not None:
            return  # the context may be unusable after an injected driver error
        cmd = sys.stdin.readline().strip()


def _nvml_used() -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)


def oom(argv: list[str]) -> None:
    """Allocate one new `--mib` tensor per step (kept alive) for `--steps`."""
    import torch

    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    mib, steps = int(opts.get("--mib", 64)), int(opts.get("--steps", 8))
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    ready()
    held, out = [], {"raised_at_step": None, "error": None}
    for i in range(1, steps + 1):
        try:
            held.append(torch.empty(mib << 20, dtype=torch.uint8, device="cuda"))
        except Exception as e:  # noqa: BLE001
            out.update(
                raised_at_step=i,
                error=err_text(e),
                is_torch_oom=isinstance(e, torch.OutOfMemoryError),
            )
            break
    out["allocated_steps"] = len(held)
    say("RESULT", out)


def leak(argv: list[str]) -> None:
    """One `--mib` tensor: NVML vs torch's own reserved memory, before/after."""
    import torch

    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    mib = int(opts.get("--mib", 1024))
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    n0, r0 = _nvml_used(), torch.cuda.memory_reserved()
    ready()
    out: dict[str, Any] = {"error": None}
    try:
        x = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        out["error"] = err_text(e)
    n1, r1 = _nvml_used(), torch.cuda.memory_reserved()
    out.update(nvml_delta=n1 - n0, reserved_delta=r1 - r0, leaked=(n1 - n0) - (r1 - r0), mib=mib)
    say("RESULT", out)


def corrupt(argv: list[str]) -> None:
    """Allocate a fresh segment and write to it with a kernel."""
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    ready({"device": torch.cuda.get_device_name(0)})
    out: dict[str, Any] = {"error": None}
    try:
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        out["data_ptr"] = hex(x.data_ptr())
        x.fill_(7)
        torch.cuda.synchronize()
        out["value"] = int(x[0].item())
    except Exception as e:  # noqa: BLE001
        out["error"] = err_text(e)
        out["illegal_address"] = "illegal memory access" in str(e) or "700" in str(e)
    say("RESULT", out)


def cublas_torch(argv: list[str]) -> None:
    """First matmul (creates the cuBLAS handle), then a GEMM loop."""
    import torch

    a = torch.randn(512, 512, device="cuda")
    torch.cuda.synchronize()
    ready()
    out: dict[str, Any] = {"first": None, "retry": None, "loop_errors": []}
    try:
        (a @ a).sum().item()
        out["first"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["first"] = err_text(e)
    try:
        (a @ a).sum().item()
        out["retry"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["retry"] = err_text(e)
    for i in range(20):
        try:
            (a @ a).sum().item()
        except Exception as e:  # noqa: BLE001
            out["loop_errors"].append([i + 1, err_text(e)])
    say("RESULT", out)


def cublas_cupy(argv: list[str]) -> None:
    import cupy
    from cupy_backends.cuda.libs import cublas  # noqa: F401 - maps libcublas now

    a = cupy.random.rand(512, 512, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    ready({"cupy": cupy.__version__})
    out: dict[str, Any] = {"first": None, "retry": None, "loop_errors": []}
    for key in ("first", "retry"):
        try:
            float((a @ a).sum())
            out[key] = "ok"
        except Exception as e:  # noqa: BLE001
            out[key] = err_text(e)
    for i in range(20):
        try:
            float((a @ a).sum())
        except Exception as e:  # noqa: BLE001
            out["loop_errors"].append([i + 1, err_text(e)])
    say("RESULT", out)


def graph(argv: list[str]) -> None:
    """Build a CUDA graph twice (the first may fail), replay it 20 times."""
    import torch

    lin = torch.nn.Linear(256, 256).cuda()
    x = torch.randn(8, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            lin(x)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    ready()
    out: dict[str, Any] = {"builds": [], "replay_errors": [], "replays_ok": 0}
    g = None
    for _ in range(2):
        try:
            gg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gg):
                y = lin(x)
            out["builds"].append("ok")
            g = gg
            break
        except Exception as e:  # noqa: BLE001
            out["builds"].append(err_text(e))
            torch.cuda.synchronize()
    if g is not None:
        for i in range(20):
            try:
                g.replay()
                torch.cuda.synchronize()
                out["replays_ok"] += 1
            except Exception as e:  # noqa: BLE001
                out["replay_errors"].append([i + 1, err_text(e)])
        out["output_finite"] = bool(torch.isfinite(y).all().item())
    say("RESULT", out)


def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def um(argv: list[str]) -> None:
    """Managed memory: allocation, prefetch, and the migration pressure mode."""
    import cupy
    import numpy as np

    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    mib, rounds = int(opts.get("--mib", 2048)), int(opts.get("--rounds", 4))
    cu = _libcuda()
    cupy.zeros(1)
    free_b, total_b = cupy.cuda.runtime.memGetInfo()
    ready({"free": free_b, "total": total_b})
    out: dict[str, Any] = {"alloc_errors": [], "prefetch_rets": []}
    size = mib << 20
    if size > free_b // 4:  # never ask for managed memory near the card's free memory
        size = free_b // 4
    mem = None
    for _ in range(2):
        try:
            mem = cupy.cuda.malloc_managed(size)
            break
        except Exception as e:  # noqa: BLE001
            out["alloc_errors"].append(err_text(e))
    if mem is None:
        say("RESULT", out)
        return
    ptr = mem.ptr
    stream = ctypes.c_void_p(0)
    cu.cuMemPrefetchAsync.argtypes = [
        ctypes.c_uint64,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    for _ in range(3):  # prefetch to device 0 through the driver API itself
        out["prefetch_rets"].append(cu.cuMemPrefetchAsync(ptr, size, 0, stream))
    cupy.cuda.Device().synchronize()
    arr = cupy.ndarray((size // 4,), dtype=cupy.float32, memptr=mem)
    host = np.ctypeslib.as_array((ctypes.c_float * (size // 4)).from_address(ptr))
    arr.fill(1.0)
    cupy.cuda.Device().synchronize()

    def gpu_pass() -> float:
        t0 = time.perf_counter()
        arr.__iadd__(1.0)
        cupy.cuda.Device().synchronize()
        return time.perf_counter() - t0

    resident = [gpu_pass() for _ in range(rounds)]
    bounced = []
    for _ in range(rounds):
        host[:: 4096 // 4] += 1.0  # touch every page on the CPU: pages migrate back
        bounced.append(gpu_pass())  # the kernel faults them onto the GPU again
    cupy.cuda.Device().synchronize()
    gb = size / 1e9
    out.update(
        size=size,
        resident_gbps=gb / min(resident),
        bounced_gbps=gb / min(bounced),
        resident_s=resident,
        bounced_s=bounced,
        value_ok=bool(float(arr[0]) == 1.0 + 3 * rounds),
    )
    say("RESULT", out)


def fft(argv: list[str]) -> None:
    """`--lib torch|cupy`: 20 FFTs of one size after READY; the first one
    creates that size's plan (so a plan fault hits it). One FFT of another
    size before READY maps libcufft: cupy loads it lazily, and a probe can
    only attach to a library the process has mapped."""
    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    lib = opts.get("--lib", "torch")
    if lib == "torch":
        import torch

        x = torch.randn(4096, dtype=torch.complex64, device="cuda")
        torch.fft.fft(x[:1000]).abs().sum().item()
        torch.cuda.synchronize()

        def one() -> None:
            torch.fft.fft(x).abs().sum().item()
    else:
        import cupy

        x = cupy.random.rand(4096).astype(cupy.complex64)
        float(cupy.abs(cupy.fft.fft(x[:1000])).sum())
        cupy.cuda.Device().synchronize()

        def one() -> None:
            float(cupy.abs(cupy.fft.fft(x)).sum())

    ready({"lib": lib})
    say("RESULT", calls(one, 20))


def nccl1(argv: list[str]) -> None:
    """A one-rank NCCL communicator on GPU 0, 20 all-reduces, through
    `--lib cupy` (cupy.cuda.nccl: the raw ncclResult_t) or `--lib torch`
    (ProcessGroupNCCL, world size 1): does an injected error surface?"""
    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    lib = opts.get("--lib", "cupy")
    if lib == "cupy":
        import cupy
        from cupy.cuda import nccl

        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        x = cupy.ones(1 << 18, dtype=cupy.float32)
        stream = cupy.cuda.Stream.null

        def one() -> None:
            comm.allReduce(
                x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr
            )
            stream.synchronize()
    else:
        import datetime

        import torch
        import torch.distributed as dist

        torch.cuda.set_device(0)
        store = dist.HashStore()
        dist.init_process_group(
            "nccl",
            store=store,
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=20),
            device_id=torch.device("cuda", 0),
        )
        x = torch.ones(1 << 18, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()

        def one() -> None:
            dist.all_reduce(x)
            torch.cuda.synchronize()

    ready({"lib": lib})
    say("RESULT", {"lib": lib, **calls(one, 20)})
    os._exit(0)  # no teardown: a failed communicator may hang in destroy


def libs(argv: list[str]) -> None:
    """Map what a torch + cupy process maps once CUDA, cuBLAS and cuFFT ran."""
    import cupy
    import torch

    a = torch.randn(64, 64, device="cuda")
    (a @ a).sum().item()
    torch.fft.fft(a).abs().sum().item()
    b = cupy.random.rand(64, 64, dtype=cupy.float32)
    float((b @ b).sum())
    ready()


WORKLOADS = {
    f.__name__: f
    for f in (decode, oom, leak, corrupt, cublas_torch, cublas_cupy, graph, um, fft, nccl1, libs)
}

if __name__ == "__main__":
    try:
        WORKLOADS[sys.argv[1]](sys.argv[2:])
    except Exception:  # noqa: BLE001
        say("CRASH", traceback.format_exc())
        sys.exit(3)
