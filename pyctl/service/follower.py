"""Rank 1 of the two-rank service (`--ranks 2 --rank 1`): no HTTP front
end, only its shard of the primary model, its own /metrics, and a worker
thread (`gf-worker`, like rank 0's) that follows rank 0:

    wait for a generation -> form the group -> loop:
        header = broadcast from rank 0
        NOOP: nothing (rank 0's heartbeat) | STOP: exit 0 |
        BATCH: receive the ids, decode with the TP model (its all_reduces),
               taking each step's token from rank 0's broadcast

A failed collective (rank 0 gave up, a partition, a timeout) puts it back
to waiting for the next generation rank 0 announces. It exits when told
to (STOP, SIGTERM), when rank 0's store refuses connections (rank 0 is
gone), and, when rank 0 spawned it, when rank 0 dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, cast

import torch
import torch.distributed as dist

from pyctl.service import dist as gdist
from pyctl.service.batcher import WORKER_NAME, _set_thread_comm
from pyctl.service.config import ServiceConfig
from pyctl.service.dist import DistError, Group, need_two_gpus
from pyctl.service.generate import GenRequest, generate
from pyctl.service.httpbase import BoundedHandler, BoundedHTTPServer
from pyctl.service.metrics import CONTENT_TYPE, FollowerMetrics
from pyctl.service.model import build_model
from pyctl.service.tp import shard

STORE_TIMEOUT = datetime.timedelta(seconds=5)
START_TIMEOUT_S = 120.0
WAIT_STEP = datetime.timedelta(seconds=1)  # a store wait, so stop and rank 0's exit are seen


def log(msg: str) -> None:
    print(f"gf-service[rank 1]: {msg}", file=sys.stderr, flush=True)


class _Handler(BoundedHandler):
    """GET /metrics and /health; the transport (bounded threads, read
    deadlines, JSON refusals) is rank 0's (pyctl/service/httpbase.py)."""

    server: _MetricsServer
    server_version = "gf-service-rank1/0.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, self.server.follower.metrics.render(), CONTENT_TYPE)
        elif path == "/health":
            status, obj = self.server.follower.health()
            self._json(status, obj)
        else:
            self._not_found()

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        self._drain()
        self._not_found()

    do_PUT = do_DELETE = do_POST

    def _not_found(self) -> None:
        self._json(404, {"error": "GET /metrics or /health"})


class _MetricsServer(BoundedHTTPServer):
    def __init__(self, addr: tuple[str, int], follower: Follower) -> None:
        self.follower = follower
        super().__init__(addr, _Handler, follower.cfg, log)


class Follower:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        gdist.set_socket_iface(cfg.dist_iface, cfg.dist_backend)
        self.dev = "cuda:1" if cfg.dist_backend == "nccl" else "cpu"
        need_two_gpus(cfg.dist_backend)
        self.metrics = FollowerMetrics(world=cfg.ranks, backend=cfg.dist_backend, device=self.dev)
        self.store = self._connect_first()
        self.group = Group(
            rank=1,
            world=cfg.ranks,
            backend=cfg.dist_backend,
            timeout_s=cfg.dist_timeout_s,
            store=self.store,
            metrics=self.metrics.dist,
        )
        self.model_cfg: dict[str, Any] = json.loads(self.store.get(gdist.MODEL_KEY))
        torch.set_num_threads(int(self.model_cfg.get("torch_threads", cfg.torch_threads)))
        full = build_model(
            vocab_size=self.model_cfg["vocab_size"],
            d_model=self.model_cfg["d_model"],
            n_heads=self.model_cfg["n_heads"],
            n_layers=self.model_cfg["n_layers"],
            max_context=self.model_cfg["max_context"],
            seed=self.model_cfg["seed"],
        )
        self.model = shard(full, 1, cfg.ranks, self.group.all_reduce).to(self.dev)
        self.stop_event = threading.Event()
        self.last_progress = time.monotonic()
        self.tid: int | None = None
        self._tid_known = threading.Event()
        self.exit_reason = ""
        self.thread = threading.Thread(target=self._main, name=WORKER_NAME, daemon=True)
        self.metrics.worker_alive.set_function(lambda: float(self.thread.is_alive()))
        self.metrics.worker_age.set_function(lambda: time.monotonic() - self.last_progress)

    # ---- the store -------------------------------------------------------------------
    def _connect(self) -> Any:
        c = self.cfg
        return dist.TCPStore(c.master_addr, c.master_port, None, False, STORE_TIMEOUT)

    def _connect_first(self) -> Any:
        """Rank 1 may start before rank 0 listens (two namespaces, two
        commands): keep trying for START_TIMEOUT_S."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pause = threading.Event()  # never set: a bounded pause between attempts
        while True:
            try:
                return self._connect()
            except RuntimeError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"rank 0's store at {self.cfg.master_addr}:{self.cfg.master_port} did "
                        f"not answer within {START_TIMEOUT_S:.0f} s ({str(e).splitlines()[0]})"
                    ) from None
                pause.wait(0.2)

    def _rank0_gone(self) -> bool:
        """Rank 0's store port refuses connections: its process is gone. (A
        partition drops the SYN instead: that times out, and we keep waiting.)"""
        try:
            with socket.create_connection((self.cfg.master_addr, self.cfg.master_port), 1.0):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def _next_generation(self, seen: int) -> int | None:
        """The newest generation rank 0 announced after `seen`; None to exit."""
        while not self.stop_event.is_set():
            self.last_progress = time.monotonic()
            try:
                cur = int(self.store.add(gdist.GEN_KEY, 0))
                if cur > seen:
                    return cur
                self.store.wait([gdist.gen_key(seen + 1)], WAIT_STEP)
            except RuntimeError as e:
                if "timeout" in str(e).lower() and "wait" in str(e).lower():
                    continue  # the generation is not there yet
                if self._rank0_gone():
                    self.exit_reason = "rank 0 is gone (its store refuses connections)"
                    return None
                try:  # a broken store connection (a partition): a new one
                    self.store = self._connect()
                    self.group.store = self.store
                except RuntimeError:
                    continue
        return None

    # ---- the worker thread ---------------------------------------------------------------
    def _main(self) -> None:
        self.tid = threading.get_native_id()
        self._tid_known.set()
        _set_thread_comm(WORKER_NAME)
        seen = 0
        try:
            if self.dev.startswith("cuda"):
                torch.cuda.set_device(self.dev)
            while not self.stop_event.is_set():
                if not self.group.up:
                    gen = self._next_generation(seen)
                    if gen is None:
                        break
                    seen = gen
                    try:
                        self.group.form(gen)
                    except DistError as e:
                        log(f"generation {gen} not formed ({e.code}: {e}); waiting for the next")
                        continue
                    log(f"process group generation {gen} formed")
                try:
                    if not self._follow_one():
                        self.exit_reason = "rank 0 said stop"
                        break
                except DistError as e:
                    log(
                        f"process group generation {self.group.generation} down "
                        f"({e.code}: {e}); waiting for rank 0's next generation"
                    )
        except Exception as e:  # one line, not a thread's traceback
            self.exit_reason = f"worker failed: {type(e).__name__}: {str(e).splitlines()[0]}"
            log(self.exit_reason)
        finally:
            self.stop_event.set()
            self._httpd_shutdown()

    def _follow_one(self) -> bool:
        """One exchange with rank 0; False on STOP."""
        cmd, rows, pad = gdist.recv_command(self.group, self.dev)
        self.last_progress = time.monotonic()
        if cmd == gdist.CMD_STOP:
            return False
        if cmd != gdist.CMD_BATCH:
            return True
        reqs = [GenRequest(ids, mt) for ids, mt in rows]
        t0 = time.monotonic()

        def beat(step: int) -> None:
            self.last_progress = time.monotonic()

        outs = generate(
            self.model,
            reqs,
            pad_id=pad,
            device=self.dev,
            on_step=beat,
            # Rank 0's token replaces ours: rank 0 samples, rank 1 follows.
            sync_next=lambda nxt: self.group.broadcast(nxt.contiguous(), 0),
        )
        self.metrics.batch_latency.labels(model="primary").observe(time.monotonic() - t0)
        self.metrics.tokens.labels(model="primary").inc(sum(len(o) for o in outs))
        return True

    def health(self) -> tuple[int, dict[str, Any]]:
        alive = self.thread.is_alive()
        return (200 if alive else 503), {
            "rank": 1,
            "pid": os.getpid(),
            "worker": {"alive": alive, "tid": self.tid,
                       "last_progress_age_s": round(time.monotonic() - self.last_progress, 3)},
            "group": "up" if self.group.up else "down",
            "generation": self.group.generation,
            "last_error": self.group.last_error,
        }  # fmt: skip

    # ---- start-up and shut-down ------------------------------------------------------------
    _httpd: _MetricsServer | None = None

    def _httpd_shutdown(self) -> None:
        h = self._httpd
        if h is not None:
            threading.Thread(target=h.shutdown, daemon=True).start()

    def serve(self) -> None:
        """Metrics endpoint, worker, announce to rank 0, then serve until the end."""
        try:
            httpd = self._httpd = _MetricsServer((self.cfg.host, self.cfg.metrics_port), self)
        except OSError as e:
            raise RuntimeError(
                f"rank 1 cannot listen on {self.cfg.host}:{self.cfg.metrics_port} "
                f"({e.strerror}): pick another --metrics-port"
            ) from None
        # An AF_INET socket's name: its host is str (typeshed allows bytes too).
        host = cast(str, httpd.server_address[0])
        url = f"http://{host}:{httpd.server_address[1]}/metrics"
        self.thread.start()
        self._tid_known.wait(10)
        info = {"rank": 1, "pid": os.getpid(), "worker_tid": self.tid, "metrics_url": url}
        self.store.set(gdist.PEER_INFO_KEY, json.dumps(info))
        self.store.set(gdist.PEER_READY_KEY, "1")
        log(f"pid {os.getpid()} worker {WORKER_NAME} tid {self.tid} metrics on {url}")

        def _term(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _term)
        try:
            httpd.serve_forever(poll_interval=0.2)
        except KeyboardInterrupt:
            self.exit_reason = self.exit_reason or "signal"
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self.stop_event.set()
            httpd.server_close()
            # The worker may sit in a collective up to the group's timeout:
            # do not wait for it (it is a daemon thread).
            self.thread.join(1.0)
            log(f"stopped ({self.exit_reason or 'stop'})")


def run_follower(cfg: ServiceConfig) -> None:
    f = Follower(cfg)
    f.serve()
    sys.stdout.flush()
    sys.stderr.flush()
    # A worker still blocked in gloo must not run interpreter finalization
    # against live C++ threads: leave at once.
    os._exit(0)
