"""`gpufault service` (also `python -m pyctl.service`): start the reference
inference service in the foreground.

Readiness is announced, never guessed: once the worker has warmed up and
the socket listens, one line `serving on http://HOST:PORT ...` goes to
stderr and, with --ready-file, a JSON file (url, pid, worker_tid, ...)
appears atomically. SIGTERM or Ctrl-C stops it (exit 0).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click

from pyctl.cli.options import Duration  # the one duration type of every command
from pyctl.service.config import CUDA_MODES, DEGRADE_MODES, DEVICES, DIST_BACKENDS, ServiceConfig


def _write_ready(path: Path, info: dict[str, Any]) -> None:
    # Written whole, then renamed: a reader never sees half a file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info) + "\n")
    os.replace(tmp, path)


@click.command(
    "service",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 80},
)
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option(
    "--port",
    type=int,
    default=8000,
    show_default=True,
    help="TCP port; 0 picks a free one (printed in the ready line)",
)
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default="cpu",
    show_default=True,
    help="cpu: torch CPU; cuda: real CUDA (GPU host); cpu-double: torch CPU and "
    "each batch also through the libcuda TEST DOUBLE",
)
@click.option("--max-batch", type=int, default=8, show_default=True, help="most requests per batch")
@click.option(
    "--batch-wait",
    type=Duration(allow_zero=True),
    default="10ms",
    show_default=True,
    help="how long the worker collects a batch after its first request",
)
@click.option(
    "--queue-size",
    type=int,
    default=64,
    show_default=True,
    help="waiting requests before new ones get 429",
)
@click.option(
    "--request-timeout",
    type=Duration(),
    default="30s",
    show_default=True,
    help="per request: answer 504 after this long",
)
@click.option(
    "--breaker-errors",
    type=int,
    default=3,
    show_default=True,
    help="consecutive device errors that open the circuit breaker",
)
@click.option(
    "--breaker-window",
    type=Duration(),
    default="30s",
    show_default=True,
    help="... within this window",
)
@click.option(
    "--breaker-cooldown",
    type=Duration(allow_zero=True),
    default="2s",
    show_default=True,
    help="open this long before a half-open probe",
)
@click.option(
    "--degrade",
    type=click.Choice(DEGRADE_MODES),
    default="fallback",
    show_default=True,
    help="while open: answer from the 1-layer fallback (degraded) or reject with 503; "
    "off: no breaker, no fallback, a device error is a 500 (a weakened build)",
)
@click.option(
    "--cuda-mode",
    type=click.Choice(CUDA_MODES),
    default="eager",
    show_default=True,
    help="cpu-double/cuda: eager launches; graph: replay a captured CUDA graph per "
    "token (eager for a batch whose replay fails); managed: activations in "
    "Unified Memory, prefetched (cpu-double only)",
)
@click.option(
    "--model-layers", type=int, default=2, show_default=True, help="layers of the primary model"
)
@click.option("--d-model", type=int, default=64, show_default=True, help="model width")
@click.option("--heads", "n_heads", type=int, default=4, show_default=True, help="attention heads")
@click.option(
    "--vocab-size",
    type=int,
    default=1000,
    show_default=True,
    help="BPE vocabulary trained at start-up",
)
@click.option(
    "--max-context", type=int, default=256, show_default=True, help="prompt + completion tokens"
)
@click.option(
    "--max-tokens-limit",
    type=int,
    default=128,
    show_default=True,
    help="largest max_tokens a request may ask for",
)
@click.option("--seed", type=int, default=1234, show_default=True, help="weights and sampling")
@click.option(
    "--torch-threads", type=int, default=1, show_default=True, help="torch intra-op threads"
)
@click.option(
    "--hang-after",
    type=Duration(),
    default="5s",
    show_default=True,
    help="/health says unhealthy when the worker made no progress for this long",
)
@click.option(
    "--max-connections",
    type=int,
    default=256,
    show_default=True,
    help="HTTP handler threads at most (one per open connection); past them: 503",
)
@click.option(
    "--idle-timeout",
    type=Duration(),
    default="30s",
    show_default=True,
    help="close a kept-alive connection that sends no next request for this long",
)
@click.option(
    "--header-timeout",
    type=Duration(),
    default="10s",
    show_default=True,
    help="408 when a request line and headers, once begun, take longer",
)
@click.option(
    "--body-timeout",
    type=Duration(),
    default="10s",
    show_default=True,
    help="408 when a body takes longer than this to arrive",
)
@click.option(
    "--perturb-control",
    is_flag=True,
    help="open /admin/perturb: bit flips in the primary model's layer outputs, armed for a "
    "bounded time by a POST (class 4 experiments; docs/service.md); needs an admin token",
)
@click.option(
    "--admin-token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="the /admin token (Authorization: Bearer TOKEN): a file only root can read; "
    "else GPUFAULT_ADMIN_TOKEN",
)
@click.option(
    "--allow-remote-admin",
    is_flag=True,
    help="with --perturb-control: allow a --host that is not loopback (/admin/perturb "
    "then answers other machines that have the token)",
)
@click.option(
    "--double-bytes-per-token",
    type=int,
    default=0,
    show_default=True,
    help="cpu-double: bytes cuMemAlloc_v2 asks per token of a batch (0: 16 x d-model x "
    "layers); cuda: a KV-cache-like scratch tensor of this many bytes per token (0: none)",
)
@click.option(
    "--ready-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="write {url, pid, worker_tid, ...} here once serving (removed on exit)",
)
@click.option(
    "--ranks",
    type=int,
    default=1,
    show_default=True,
    help="2: a tensor-parallel primary model over two processes (torch.distributed)",
)
@click.option(
    "--rank",
    type=int,
    default=0,
    show_default=True,
    help="with --ranks 2: 0 serves HTTP; 1 follows rank 0 (start it by hand with "
    "--no-spawn-peer on rank 0)",
)
@click.option(
    "--dist-backend",
    type=click.Choice(DIST_BACKENDS),
    default="gloo",
    show_default=True,
    help="gloo on the CPU; nccl with --device cuda on two GPUs (rank r on cuda:r)",
)
@click.option(
    "--dist-timeout",
    type=Duration(),
    default="10s",
    show_default=True,
    help="a collective or group formation longer than this fails (DIST_TIMEOUT)",
)
@click.option(
    "--master-addr",
    default="127.0.0.1",
    show_default=True,
    help="address of rank 0's rendezvous store (rank 0 listens there)",
)
@click.option(
    "--master-port",
    type=int,
    default=0,
    show_default=True,
    help="port of the rendezvous store; 0 on rank 0 picks a free one (printed)",
)
@click.option(
    "--dist-iface",
    help="network interface this rank's collectives use (GLOO_SOCKET_IFNAME / "
    "NCCL_SOCKET_IFNAME), e.g. a veth end in a network namespace",
)
@click.option(
    "--spawn-peer/--no-spawn-peer",
    default=True,
    show_default=True,
    help="rank 0 starts rank 1 itself, or waits for one started by hand",
)
@click.option(
    "--metrics-port",
    type=int,
    default=0,
    show_default=True,
    help="rank 1: port of its own /metrics (0 picks one, announced in rank 0's ready file)",
)
def service(
    host: str,
    port: int,
    device: str,
    max_batch: int,
    batch_wait: float,
    queue_size: int,
    request_timeout: float,
    breaker_errors: int,
    breaker_window: float,
    breaker_cooldown: float,
    degrade: str,
    cuda_mode: str,
    model_layers: int,
    d_model: int,
    n_heads: int,
    vocab_size: int,
    max_context: int,
    max_tokens_limit: int,
    seed: int,
    torch_threads: int,
    hang_after: float,
    max_connections: int,
    idle_timeout: float,
    header_timeout: float,
    body_timeout: float,
    perturb_control: bool,
    admin_token_file: Path | None,
    allow_remote_admin: bool,
    double_bytes_per_token: int,
    ready_file: Path | None,
    ranks: int,
    rank: int,
    dist_backend: str,
    dist_timeout: float,
    master_addr: str,
    master_port: int,
    dist_iface: str | None,
    spawn_peer: bool,
    metrics_port: int,
) -> None:
    """Run the reference inference service that experiments target.

    A small transformer with seeded random weights, a BPE tokenizer trained
    at start-up, dynamic batching on one worker thread (gf-worker), load
    shedding (429), and a circuit breaker that answers from a 1-layer model
    ("degraded": true) or with 503 after repeated device errors.
    Endpoints: POST /v1/completions, GET /health, GET /metrics.

    \b
    Examples:
      gpufault service --port 0 --ready-file /tmp/svc.json
      gpufault service --device cpu-double --breaker-errors 3 --port 8000
      gpufault service --ranks 2 --port 0      # rank 1 too, gloo, tensor-parallel
      curl -s localhost:8000/v1/completions -d '{"prompt": "hi", "max_tokens": 8}'
      gpufault inject --pid "$(jq .pid /tmp/svc.json)" \\
          --lib pyctl/data/doubles/libcuda.so.1 --fn cuMemAlloc_v2 \\
          --action fail --ret 2 --sticky --duration 10s
    """
    cfg = ServiceConfig(
        host=host,
        port=port,
        device=device,
        max_batch=max_batch,
        batch_wait_ms=batch_wait * 1000.0,
        queue_size=queue_size,
        request_timeout_s=request_timeout,
        breaker_errors=breaker_errors,
        breaker_window_s=breaker_window,
        breaker_cooldown_s=breaker_cooldown,
        degrade=degrade,
        cuda_mode=cuda_mode,
        model_layers=model_layers,
        d_model=d_model,
        n_heads=n_heads,
        vocab_size=vocab_size,
        max_context=max_context,
        max_tokens_limit=max_tokens_limit,
        default_max_tokens=min(16, max_tokens_limit),
        seed=seed,
        torch_threads=torch_threads,
        hang_after_s=hang_after,
        max_connections=max_connections,
        idle_timeout_s=idle_timeout,
        header_timeout_s=header_timeout,
        body_timeout_s=body_timeout,
        perturb_control=perturb_control,
        admin_token=_admin_token(admin_token_file) if perturb_control else None,
        allow_remote_admin=allow_remote_admin,
        double_bytes_per_token=double_bytes_per_token,
        ready_file=str(ready_file) if ready_file else None,
        ranks=ranks,
        rank=rank,
        dist_backend=dist_backend,
        dist_timeout_s=dist_timeout,
        master_addr=master_addr,
        master_port=master_port,
        dist_iface=dist_iface,
        spawn_peer=spawn_peer,
        metrics_port=metrics_port,
    )
    try:
        cfg.check()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if cfg.ranks == 2:
        # c10d logs a warning for every bounded store wait (how both ranks
        # poll for rank 1 / the next generation): keep stderr readable.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if cfg.ranks == 2 and cfg.rank == 1:
        _run_follower(cfg)
        return
    run(cfg)


def _admin_token(token_file: Path | None) -> str:
    """--perturb-control's token, or one line and status 2 (no token: the
    control does not start; pyctl/service/perturb.py says why)."""
    # lazy: keeps pyctl.service.perturb (hashlib, hmac, +5 modules) off `--help`
    from pyctl.service.perturb import AdminTokenError, admin_token

    try:
        return admin_token(str(token_file) if token_file else None)
    except AdminTokenError as e:
        raise click.UsageError(str(e)) from None


def _run_follower(cfg: ServiceConfig) -> None:
    try:
        # lazy: the service needs torch, which gpufault itself does not depend on
        from pyctl.service.follower import run_follower
    except ImportError as e:
        raise click.ClickException(f"the service needs torch ({e}): pip install torch") from None
    try:
        run_follower(cfg)
    except (RuntimeError, OSError) as e:
        raise click.ClickException(f"rank 1 did not start: {str(e).splitlines()[0]}") from None


def run(cfg: ServiceConfig) -> None:
    """Start, announce readiness, serve until SIGTERM/SIGINT, clean up."""
    try:
        # lazy: the service needs torch, which gpufault itself does not depend on
        from pyctl.service.app import Service, log
        from pyctl.service.server import ServiceHTTPServer
    except ImportError as e:
        # torch is not a dependency of gpufault itself (GPU hosts bring their own).
        raise click.ClickException(
            f"the service needs torch, tokenizers and prometheus-client ({e}): "
            "pip install torch tokenizers prometheus-client"
        ) from None

    try:
        if cfg.ranks == 2:
            # lazy: keeps pyctl.service.ranks (+1044 modules, ~9 s) off `--help`
            from pyctl.service.ranks import RankZeroService

            svc: Service = RankZeroService(cfg)
        else:
            svc = Service(cfg)
    except (RuntimeError, OSError, TimeoutError) as e:
        raise click.ClickException(f"service did not start: {str(e).splitlines()[0]}") from None
    try:
        svc.start()
    except (RuntimeError, OSError, TimeoutError) as e:
        svc.stop()  # a spawned rank 1 too
        raise click.ClickException(f"service did not start: {str(e).splitlines()[0]}") from None
    try:
        httpd = ServiceHTTPServer((cfg.host, cfg.port), svc)
    except OSError as e:
        svc.stop()
        raise click.ClickException(
            f"cannot listen on {cfg.host}:{cfg.port} ({e.strerror}): pick another --port "
            "(0 picks a free one)"
        ) from None
    host, port = str(httpd.server_address[0]), int(httpd.server_address[1])
    url = f"http://{host}:{port}"

    def _term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # leaves serve_forever in this (the main) thread

    signal.signal(signal.SIGTERM, _term)
    ready = Path(cfg.ready_file) if cfg.ready_file else None
    info: dict[str, Any] = {  # JSON for the ready file (_write_ready's type)
        "url": url,
        "host": host,
        "port": port,
        "pid": os.getpid(),
        "worker_tid": svc.worker.tid,
        "worker_name": svc.worker.thread.name,
        "device": cfg.device,
        "libcuda_test_double": svc.backend.double,
    }
    ranks_info = getattr(svc, "ranks_info", None)
    if ranks_info is not None:
        info["ranks"] = ranks_info(url)
    try:
        if ready is not None:
            _write_ready(ready, info)
        double = " (libcuda TEST DOUBLE)" if svc.backend.double else ""
        print(
            f"serving on {url} pid {os.getpid()} device {cfg.device}{double} "
            f"worker {svc.worker.thread.name} tid {svc.worker.tid}"
            + "".join(
                f" rank {r['rank']} pid {r['pid']} tid {r['worker_tid']}"
                for r in info.get("ranks", [])[1:]
            ),
            file=sys.stderr,
            flush=True,
        )
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        httpd.server_close()
        svc.stop()
        if ready is not None:
            ready.unlink(missing_ok=True)
        log("stopped")


def main() -> None:
    service(prog_name="gpufault service")


if __name__ == "__main__":
    main()
