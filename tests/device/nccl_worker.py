"""One rank of the NCCL all-reduce loop (torch.distributed, one GPU a rank).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. python -m tests.device.nccl_worker N TIMEOUT_S

Prints READY after init and a warm-up collective, waits for a line on
stdin, runs N all-reduces of 1 MiB timing each (host-side, synchronized),
and prints RESULT with p50/p99 and the first error. On an error it stops,
like an application would, and leaves without tearing down the
communicator (peers then depend on PyTorch's NCCL watchdog).
GF_PAUSE_AT=K sleeps 3 s before iteration K (the controller cuts the
network then).
"""

from __future__ import annotations

import datetime
import os
import sys
import time

from tests.device.workloads import err_text, ready, say


def main() -> None:
    import torch
    import torch.distributed as dist

    n, timeout_s = int(sys.argv[1]), int(sys.argv[2])
    rank = int(os.environ["RANK"])
    # GF_NCCL_BACKEND=gloo runs the same loop on CPUs (a harness check where
    # no GPU is; it exercises no NCCL code).
    backend = os.environ.get("GF_NCCL_BACKEND", "nccl")
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", rank))
        sync, dev = torch.cuda.synchronize, "cuda"
    else:
        dist.init_process_group(backend, timeout=timeout)
        sync, dev = (lambda: None), "cpu"
    x = torch.ones(256 * 1024, device=dev)  # 1 MiB of fp32
    for _ in range(5):
        dist.all_reduce(x)
    sync()
    ready({"rank": rank})
    pause_at = int(os.environ.get("GF_PAUSE_AT", "0"))
    lat, err, t_err = [], None, None
    t_start = time.perf_counter()
    for i in range(1, n + 1):
        if i == pause_at:
            time.sleep(3)
        x.fill_(1.0)
        t0 = time.perf_counter()
        try:
            dist.all_reduce(x)
            sync()
        except Exception as e:  # noqa: BLE001
            err, t_err = f"iteration {i}: {err_text(e)}", time.perf_counter() - t_start
            break
        lat.append((time.perf_counter() - t0) * 1e3)
    lat_sorted = sorted(lat) or [0.0]

    def pct(p: float) -> float:
        return lat_sorted[min(len(lat_sorted) - 1, int(p * len(lat_sorted)))]

    say(
        "RESULT",
        {
            "rank": rank,
            "iterations": len(lat),
            "p50_ms": pct(0.5),
            "p99_ms": pct(0.99),
            "max_ms": lat_sorted[-1],
            "error": err,
            "error_after_s": t_err,
            "sum_ok": bool(err is None and float(x[0]) == 2.0),
        },
    )
    if err is not None:
        os._exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
