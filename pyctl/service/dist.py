"""The two ranks' process group: formation, re-formation, collectives, errors.

Each rank builds the group itself (ProcessGroupGloo / ProcessGroupNCCL
over a PrefixStore of rank 0's TCPStore), not through
`init_process_group`: a gloo group whose collective timed out or whose
peer vanished is broken for good ("Application timeout caused pair
closure"), and the global default group cannot be replaced. So every
formation is a *generation* g with its own key prefix `gf/pg{g}/`; rank 0
announces g by `add("gf/gen", 1)` plus a key `gf/gen{g}`, and rank 1 joins
the newest generation it sees. Both ranks then issue the same collectives
in the same order, from one thread each (the `gf-worker`).

A failed collective raises DistError, a DeviceError with code
DIST_TIMEOUT (the group's timeout expired: a partition, a stalled peer) or
DIST_ERROR (the peer closed or reset the connection: it died, or it gave
up first), so the service's breaker counts it like any device error.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pyctl.service.device import DeviceError
from pyctl.service.metrics import DistMetrics

GEN_KEY = "gf/gen"  # the newest generation rank 0 announced (a counter)
MODEL_KEY = "gf/model"  # rank 0's model settings, JSON, so rank 1 builds the same weights
PEER_INFO_KEY = "gf/rank1/info"  # rank 1's {rank, pid, worker_tid, metrics_url}
PEER_READY_KEY = "gf/rank1/ready"  # rank 1 waits for generations from now on

# Commands rank 0 broadcasts in the header of every exchange.
CMD_NOOP, CMD_BATCH, CMD_STOP = 0, 1, 2
HEADER_LEN = 4  # [cmd, batch size, width, pad id]
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


class DistError(DeviceError):
    """A collective or a group formation failed (code DIST_TIMEOUT / DIST_ERROR)."""


def classify(exc: BaseException, what: str) -> DistError:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # gloo: "Timed out waiting 2000ms for recv operation"; NCCL's watchdog:
    # "Watchdog caught collective operation timeout"; the store: "wait timeout".
    low = text.lower()
    timeout = "timed out" in low or "timeout" in low
    return DistError("DIST_TIMEOUT" if timeout else "DIST_ERROR", f"{what}: {text}", what)


def gen_key(gen: int) -> str:
    return f"{GEN_KEY}{gen}"


class Group:
    """One rank's view of the (current generation of the) process group."""

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        backend: str,
        timeout_s: float,
        store: Any,
        metrics: DistMetrics | None = None,
        on_down: Callable[[DistError], None] | None = None,
    ) -> None:
        self.rank, self.world, self.backend = rank, world, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store
        self.metrics = metrics
        self.on_down = on_down
        self.pg: Any = None  # None while down
        self.generation = 0
        self.last_error: str | None = None
        self.down_since: float | None = time.monotonic()
        self.last_collective = time.monotonic()
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        return self.pg is not None

    def form(self, gen: int) -> None:
        """Join generation `gen` (blocks until both ranks joined, or the
        timeout: then DistError)."""
        prefix = dist.PrefixStore(f"gf/pg{gen}/", self.store)
        try:
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                pg: Any = dist.ProcessGroupNCCL(prefix, self.rank, self.world, opts)
            else:
                pg = dist.ProcessGroupGloo(prefix, self.rank, self.world, self.timeout)
        except RuntimeError as e:
            err = classify(e, f"process group generation {gen}")
            self._count_error(err)
            raise err from e
        with self._lock:
            self.pg, self.generation = pg, gen
            self.down_since = None
            self.last_collective = time.monotonic()
        if self.metrics is not None:
            self.metrics.group_up.set(1)
            self.metrics.generation.set(gen)

    def fail(self, err: DistError) -> None:
        """Mark the group down. Dropping the gloo group closes its pairs, so
        the peer's pending collective fails at once instead of at its timeout."""
        with self._lock:
            pg, was_up = self.pg, self.pg is not None
            self.pg = None
        if pg is not None and self.backend == "nccl":
            # A failed NCCL communicator must be aborted, not just dropped.
            try:
                pg.abort()
            except (RuntimeError, AttributeError):
                pass
        with self._lock:
            self.last_error = f"{err.code}: {err}"
            if was_up:
                self.down_since = time.monotonic()
        if self.metrics is not None:
            self.metrics.group_up.set(0)
        if was_up and self.on_down is not None:
            self.on_down(err)

    def _count_error(self, err: DistError) -> None:
        if self.metrics is not None:
            self.metrics.errors.labels(code=err.code).inc()

    def _run(self, op: str, issue: Callable[[Any], Any]) -> None:
        pg = self.pg
        if pg is None:
            raise DistError(
                "DIST_ERROR",
                f"process group down (re-forming); last error: {self.last_error}",
                "process_group",
            )
        t0 = time.monotonic()
        try:
            issue(pg).wait()
        except RuntimeError as e:
            err = classify(e, op)
            self._count_error(err)
            self.fail(err)
            raise err from e
        self.last_collective = done = time.monotonic()
        if self.metrics is not None:
            self.metrics.collectives.labels(op=op).inc()
            self.metrics.collective_latency.labels(op=op).observe(done - t0)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (the TP layers' collective)."""
        self._run("all_reduce", lambda pg: pg.allreduce([t]))
        return t

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        self._run("broadcast", lambda pg: pg.broadcast(t, root))
        return t


def set_socket_iface(iface: str | None, backend: str) -> None:
    """Which interface this rank's collectives use (both ranks in their own
    network namespaces: the veth end there). Read when a group is formed."""
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
        if backend == "nccl":
            os.environ["NCCL_SOCKET_IFNAME"] = iface
    if backend == "nccl":
        # Blocking waits: a timed-out NCCL collective raises in the worker
        # thread (DIST_TIMEOUT, counted by the breaker) rather than only in
        # torch's watchdog thread. Untested here: no two GPUs (docs/gpu-validation.md).
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        # The GPU host's rule: NVLink multicast stays off in every process
        # (it can take the shared host's GPUs out of service).
        for k, v in NO_MULTICAST.items():
            os.environ.setdefault(k, v)


def need_two_gpus(backend: str) -> None:
    if backend != "nccl":
        return
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        raise RuntimeError(
            f"--dist-backend nccl puts rank r on cuda:r and needs two GPUs; torch sees {n}: "
            "use --dist-backend gloo --device cpu here"
        )


# ---- the exchange both ranks run per batch ------------------------------------
def send_batch(
    group: Group, rows: list[list[int]], max_tokens: list[int], pad_id: int, device: str
) -> None:
    """Rank 0: the batch's header, then its ids (row: [len, max_tokens, ids left-padded])."""
    width = max(len(r) for r in rows)
    group.broadcast(
        torch.tensor([CMD_BATCH, len(rows), width, pad_id], dtype=torch.long, device=device)
    )
    body = [
        [len(r), m] + [pad_id] * (width - len(r)) + r for r, m in zip(rows, max_tokens, strict=True)
    ]
    group.broadcast(torch.tensor(body, dtype=torch.long, device=device))


def send_command(group: Group, cmd: int, device: str) -> None:
    group.broadcast(torch.tensor([cmd, 0, 0, 0], dtype=torch.long, device=device))


def recv_command(group: Group, device: str) -> tuple[int, list[tuple[list[int], int]], int]:
    """Rank 1: (cmd, [(ids, max_tokens)] for a batch, pad id)."""
    head = group.broadcast(torch.zeros(HEADER_LEN, dtype=torch.long, device=device))
    cmd, n, width, pad = (int(x) for x in head.tolist())
    if cmd != CMD_BATCH:
        return cmd, [], pad
    body = group.broadcast(torch.zeros(n, width + 2, dtype=torch.long, device=device))
    reqs = []
    for row in body.tolist():
        length, mt = row[0], row[1]
        reqs.append((row[2 + width - length :], mt))
    return cmd, reqs, pad
