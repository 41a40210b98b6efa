"""Rank 0 of the two-rank service (`--ranks 2`): the HTTP service whose
primary model is tensor-parallel over two processes.

Rank 0 is the ordinary Service (HTTP, queue, batching, breaker, fallback)
plus:
- the rendezvous store (a TCPStore on --master-addr:--master-port; port 0
  picks a free one, printed as `rendezvous on ADDR:PORT`), and rank 1
  itself unless --no-spawn-peer (then rank 1 is started by hand, for
  example in another network namespace: docs/service.md, "Two ranks");
- per batch, its worker broadcasts the batch's ids to rank 1, both ranks
  run the TP model (all_reduces in every block) and rank 0 broadcasts the
  token it sampled at each step;
- a heartbeat (a NOOP broadcast) when no collective ran for HEARTBEAT_S,
  so rank 1's wait for the next batch never reaches the group's timeout
  and a dead rank 1 is seen while idle;
- on a failed collective (DIST_TIMEOUT / DIST_ERROR: a device error of the
  batch, counted by the breaker) the group is down: batches fail fast
  (DIST_ERROR, so the breaker opens and the fallback or 503 answers) while
  a `gf-dist-heal` thread forms the next generation; the first batch
  after it formed (a half-open probe) closes the breaker again.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

import torch.distributed as dist

from pyctl import paths
from pyctl.service import dist as gdist
from pyctl.service.app import Service, log
from pyctl.service.batcher import Pending
from pyctl.service.config import ServiceConfig
from pyctl.service.dist import DistError, Group
from pyctl.service.generate import GenRequest, generate
from pyctl.service.metrics import DistMetrics
from pyctl.service.model import TinyCausalLM
from pyctl.service.tp import shard

HEARTBEAT_S = 1.0  # idle rank 0 proves the group alive this often
START_TIMEOUT_S = 120.0  # rank 1 imports torch and builds its shard meanwhile
STORE_TIMEOUT = datetime.timedelta(seconds=30)


def _pdeathsig() -> None:
    """In the spawned rank 1, before exec: SIGTERM when rank 0 dies (even by
    SIGKILL), so a dead rank 0 never leaves its rank 1 behind."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def follower_argv(cfg: ServiceConfig, port: int) -> list[str]:
    """The command line of the rank 1 that rank 0 spawns (model settings
    come through the store, so rank 1 cannot disagree on them)."""
    # Isolated (pyctl.paths.module_argv): rank 1 runs as rank 0's user,
    # root under an experiment, and must not import from the cwd.
    argv = paths.module_argv("pyctl.service", [
        "--ranks", "2", "--rank", "1",
        "--device", cfg.device, "--dist-backend", cfg.dist_backend,
        "--dist-timeout", repr(cfg.dist_timeout_s), "--master-addr", cfg.master_addr,
        "--master-port", str(port), "--host", cfg.host, "--metrics-port", "0",
        "--torch-threads", str(cfg.torch_threads),
        # Rank 1's /metrics listener holds connections as rank 0's front
        # end does (pyctl/service/httpbase.py), within the same limits.
        "--max-connections", str(cfg.max_connections),
        "--idle-timeout", repr(cfg.idle_timeout_s),
        "--header-timeout", repr(cfg.header_timeout_s),
        "--body-timeout", repr(cfg.body_timeout_s),
    ])  # fmt: skip
    if cfg.dist_iface:
        argv += ["--dist-iface", cfg.dist_iface]
    return argv


class RankZeroService(Service):
    def __init__(self, cfg: ServiceConfig) -> None:
        gdist.need_two_gpus(cfg.dist_backend)  # before anything is started
        super().__init__(cfg)
        gdist.set_socket_iface(cfg.dist_iface, cfg.dist_backend)
        self.dev = "cuda:0" if cfg.dist_backend == "nccl" else "cpu"
        self.dist_metrics = DistMetrics(
            self.metrics.registry, rank=0, world=cfg.ranks, backend=cfg.dist_backend
        )
        # The store server lives in this process: rank 0 is the master.
        self.store = dist.TCPStore(
            cfg.master_addr, cfg.master_port, None, True, STORE_TIMEOUT, wait_for_workers=False
        )
        self.master_port = int(self.store.port)
        self.group = Group(
            rank=0,
            world=cfg.ranks,
            backend=cfg.dist_backend,
            timeout_s=cfg.dist_timeout_s,
            store=self.store,
            metrics=self.dist_metrics,
            on_down=self._group_down,
        )
        self.dist_metrics.group_up.set(0)
        # The same full model every rank draws from --seed, then this rank's shard.
        self.primary = shard(self.primary, 0, cfg.ranks, self.group.all_reduce)
        self.store.set(
            gdist.MODEL_KEY,
            json.dumps(
                {
                    "vocab_size": self.tok.vocab_size,
                    "d_model": cfg.d_model,
                    "n_heads": cfg.n_heads,
                    "n_layers": cfg.model_layers,
                    "max_context": cfg.max_context,
                    "seed": cfg.seed,
                    "torch_threads": cfg.torch_threads,
                }
            ),
        )
        self.peer_info: dict[str, Any] = {}
        self.peer: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._healer: threading.Thread | None = None
        self._heal_lock = threading.Lock()
        self.worker.on_idle = self._heartbeat
        log(
            f"rank 0 rendezvous on {cfg.master_addr}:{self.master_port} "
            f"(backend {cfg.dist_backend}, timeout {cfg.dist_timeout_s:g} s)"
        )
        if cfg.spawn_peer:
            self.peer = subprocess.Popen(
                follower_argv(cfg, self.master_port),
                stdin=subprocess.DEVNULL,
                preexec_fn=_pdeathsig,  # noqa: PLW1509 (no threads run yet that could deadlock it)
            )

    # ---- lifecycle -------------------------------------------------------------
    def _worker_start(self) -> None:
        """In the worker thread: the device, rank 1's arrival, generation 1,
        and a warm-up batch that both ranks decode."""
        self.backend.open()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self._peer_exited("while starting")
            try:
                self.store.wait([gdist.PEER_READY_KEY], datetime.timedelta(seconds=1))
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rank 1 did not join within {START_TIMEOUT_S:.0f} s"
                    ) from None
        self.peer_info = json.loads(self.store.get(gdist.PEER_INFO_KEY))
        self._form_next()
        self.primary.to(self.dev)
        warm = [GenRequest(self.tok.encode("warm up"), 1)]
        self._decode(self.primary, warm, self.dev, None)
        generate(self.fallback, warm, pad_id=self.tok.pad_id)

    def _peer_exited(self, when: str) -> None:
        if self.peer is not None and self.peer.poll() is not None:
            raise RuntimeError(
                f"rank 1 (pid {self.peer.pid}) exited {when} with status {self.peer.returncode}"
            )

    def _form_next(self) -> int:
        gen = int(self.store.add(gdist.GEN_KEY, 1))
        self.store.set(gdist.gen_key(gen), "1")
        t0 = time.monotonic()
        self.group.form(gen)
        log(f"process group generation {gen} formed in {time.monotonic() - t0:.3f} s")
        return gen

    def stop(self) -> None:
        """Stop the worker, tell rank 1 to stop, reap it (nothing left behind)."""
        self._stopping.set()
        super().stop()
        if not self.worker.alive() and self.group.up:
            # The worker is gone: this thread is now the only one issuing collectives.
            try:
                gdist.send_command(self.group, gdist.CMD_STOP, self.dev)
            except DistError:
                pass
        self.group.pg = None
        if self.peer is not None:
            try:
                self.peer.wait(5)
            except subprocess.TimeoutExpired:
                self.peer.terminate()
                try:
                    self.peer.wait(5)
                except subprocess.TimeoutExpired:
                    self.peer.kill()
                    self.peer.wait()

    # ---- the group going down and coming back -------------------------------------
    def _group_down(self, err: DistError) -> None:
        log(
            f"process group generation {self.group.generation} down ({err.code}: {err}); re-forming"
        )
        with self._heal_lock:
            if self._healer is not None and self._healer.is_alive():
                return
            self._healer = threading.Thread(target=self._heal, name="gf-dist-heal", daemon=True)
            self._healer.start()

    def _heal(self) -> None:
        while not self._stopping.is_set() and not self.group.up:
            if self.peer is not None and self.peer.poll() is not None:
                log(
                    f"rank 1 (pid {self.peer.pid}) exited with status {self.peer.returncode}: "
                    "not re-forming the group"
                )
                return
            try:
                self._form_next()
            except DistError:
                # Rank 1 did not join within the timeout (partitioned, dead, or
                # still in its own failed collective): announce the next one.
                self._stopping.wait(0.1)

    def _heartbeat(self) -> None:
        """A NOOP broadcast when the group was quiet for HEARTBEAT_S (worker thread)."""
        if not self.group.up or time.monotonic() - self.group.last_collective < HEARTBEAT_S:
            return
        try:
            gdist.send_command(self.group, gdist.CMD_NOOP, self.dev)
        except DistError as e:
            # A device error like a batch's: the breaker counts it.
            self.metrics.errors.labels(kind="device", code=e.code).inc()
            self.breaker.failure(f"heartbeat: {e.code}")

    # ---- the batch path ------------------------------------------------------------
    def _run_batch(self, batch: list[Pending]) -> None:
        # Under constant load the worker is never idle: beat here too, so
        # rank 1 hears from rank 0 while the fallback answers.
        self._heartbeat()
        super()._run_batch(batch)

    def _decode(
        self, model: TinyCausalLM, reqs: list[GenRequest], device: str, hook: Any
    ) -> list[list[int]]:
        if model is not self.primary:
            return super()._decode(model, reqs, device, hook)
        # Fail fast while the group is down: a DIST_ERROR for the breaker, no wait.
        gdist.send_batch(
            self.group, [r.ids for r in reqs], [r.max_tokens for r in reqs], self.tok.pad_id,
            self.dev,
        )  # fmt: skip

        def on_step(step: int) -> None:
            self.worker.beat()
            if hook is not None:
                hook(step)

        return generate(
            model,
            reqs,
            pad_id=self.tok.pad_id,
            banned=self.tok.special_ids,
            device=self.dev,
            on_step=on_step,
            sync_next=lambda nxt: self.group.broadcast(nxt.contiguous(), 0),
            on_tokens=self._emit if self._batch is not None else None,
        )

    # ---- health and the ready file ----------------------------------------------------
    def ranks_info(self, url: str) -> list[dict[str, Any]]:
        me = {
            "rank": 0,
            "pid": os.getpid(),
            "worker_tid": self.worker.tid,
            "metrics_url": f"{url}/metrics",
        }
        return [
            me,
            {k: self.peer_info.get(k) for k in ("rank", "pid", "worker_tid", "metrics_url")},
        ]

    def health(self) -> tuple[int, dict[str, Any]]:
        status, body = super().health()
        g = self.group
        peer_exit = self.peer.poll() if self.peer is not None else None
        body["dist"] = {
            "world_size": self.cfg.ranks,
            "backend": self.cfg.dist_backend,
            "group": "up" if g.up else "down",
            "generation": g.generation,
            "down_for_s": None
            if g.down_since is None
            else round(time.monotonic() - g.down_since, 3),
            "last_error": g.last_error,
            "timeout_s": self.cfg.dist_timeout_s,
            "peer": {**self.peer_info, "exited": peer_exit},
        }
        if peer_exit is not None:
            body["reasons"].append(
                f"rank 1 (pid {self.peer_info.get('pid')}) exited with status {peer_exit}"
            )
        if not g.up:
            body["reasons"].append(
                f"process group down (generation {g.generation}, last error: {g.last_error}): "
                "the primary model cannot run"
            )
        if (peer_exit is not None or not g.up) and body["status"] == "ok":
            body["status"] = "degraded"
        return status, body
