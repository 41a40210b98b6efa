"""Every knob of the service in one checked value.

The CLI, the tests and any embedding code build a ServiceConfig; `check()`
is the one place that says what a valid setting is, so the HTTP layer and
the worker never re-validate.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

# cpu: plain torch on the CPU. cuda: real CUDA through torch (the GPU host).
# cpu-double: torch on the CPU, and every batch also goes through the
# libcuda TEST DOUBLE (alloc, launch, synchronize, free) so that faults
# injected into the double's driver API surface as device errors.
DEVICES = ("cpu", "cuda", "cpu-double")
# What the breaker does while open: answer from the 1-layer fallback model
# (marked "degraded": true) or refuse with 503. "off" is the deliberately
# weakened build (docs/explore.md, "A weakened service"): no breaker and no
# fallback, a device error fails its batch's requests with 500 and the next
# batch tries the device again, as a service without error handling would.
DEGRADE_MODES = ("fallback", "reject", "off")
# --ranks 2: torch.distributed between two processes (tensor-parallel
# primary model). gloo runs on the CPU (and is what runs in CI); nccl needs
# --device cuda and two GPUs (rank r on cuda:r).
DIST_BACKENDS = ("gloo", "nccl")
# How the primary model's per-token device work is issued (docs/service.md,
# "CUDA modes"): eager launches; a captured CUDA graph replayed per token
# (falls back to eager for a batch whose replay fails); or activations in
# Unified Memory (cuMemAllocManaged + cuMemPrefetchAsync).
CUDA_MODES = ("eager", "graph", "managed")


@dataclass
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: the kernel picks a free port (printed on start-up)
    device: str = "cpu"
    # model
    model_layers: int = 2
    fallback_layers: int = 1
    d_model: int = 64
    n_heads: int = 4
    vocab_size: int = 1000
    max_context: int = 256
    seed: int = 1234
    torch_threads: int = 1
    # request limits
    max_tokens_limit: int = 128
    default_max_tokens: int = 16
    # batching and queue
    max_batch: int = 8
    batch_wait_ms: float = 10.0
    queue_size: int = 64
    request_timeout_s: float = 30.0
    # breaker
    breaker_errors: int = 3
    breaker_window_s: float = 30.0
    breaker_cooldown_s: float = 2.0
    degrade: str = "fallback"
    cuda_mode: str = "eager"
    # health: a worker that has made no progress for this long is hung
    hang_after_s: float = 5.0
    # the HTTP front against slow or hostile clients (docs/service.md,
    # "Input handling"): handler threads at most, and how long a kept-alive
    # connection may wait idle, its request line + headers and its body
    max_connections: int = 256
    idle_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    # /admin/perturb: Tensor Core bit flips in the primary model (class 4)
    perturb_control: bool = False
    # ... and its token (--admin-token-file or GPUFAULT_ADMIN_TOKEN): kept out of repr
    admin_token: str | None = field(default=None, repr=False)
    allow_remote_admin: bool = False  # --perturb-control on a --host that is not loopback
    # cpu-double: bytes of "activations" per token of a batch (allocated
    # with the double's cuMemAlloc_v2); 0 = d_model * 4 * model_layers * 4
    double_bytes_per_token: int = 0
    ready_file: str | None = None
    # two ranks (docs/service.md, "Two ranks"): 1 keeps the one-process service
    ranks: int = 1
    rank: int = 0  # 1: this process is the follower rank (no HTTP front end)
    dist_backend: str = "gloo"
    dist_timeout_s: float = 10.0  # a collective (or group formation) longer than this fails
    master_addr: str = "127.0.0.1"  # where rank 0's rendezvous store listens
    master_port: int = 0  # 0: rank 0 picks a free one and prints it
    dist_iface: str | None = None  # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for this rank
    spawn_peer: bool = True  # rank 0 starts rank 1 itself (off: it is started by hand)
    metrics_port: int = 0  # rank 1's /metrics port (0: a free one, announced to rank 0)

    def check(self) -> ServiceConfig:
        """Raises ValueError naming the setting and what to do."""

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.device in DEVICES, f"--device {self.device}: choose one of {', '.join(DEVICES)}")
        need(
            self.degrade in DEGRADE_MODES,
            f"--degrade {self.degrade}: choose one of {', '.join(DEGRADE_MODES)}",
        )
        need(
            self.cuda_mode in CUDA_MODES,
            f"--cuda-mode {self.cuda_mode}: choose one of {', '.join(CUDA_MODES)}",
        )
        if self.cuda_mode != "eager":
            self._check_cuda_mode(need)
        need(0 <= self.port <= 65535, f"--port {self.port}: give 0..65535 (0 picks a free port)")
        need(self.model_layers >= 1, "--model-layers must be at least 1")
        need(self.fallback_layers >= 1, "--fallback-layers must be at least 1")
        need(self.d_model >= 8, "--d-model must be at least 8")
        need(self.n_heads >= 1, "--heads must be at least 1")
        need(
            self.d_model % self.n_heads == 0,
            f"--d-model {self.d_model} must be a multiple of --heads {self.n_heads}",
        )
        need(self.vocab_size >= 300, "--vocab-size must be at least 300 (256 bytes + specials)")
        need(self.max_context >= 8, "--max-context must be at least 8")
        need(self.torch_threads >= 1, "--torch-threads must be at least 1")
        need(
            1 <= self.max_tokens_limit < self.max_context,
            f"--max-tokens-limit must be 1..{self.max_context - 1} (below --max-context)",
        )
        need(
            1 <= self.default_max_tokens <= self.max_tokens_limit,
            "--default-max-tokens must be 1..--max-tokens-limit",
        )
        need(self.max_batch >= 1, "--max-batch must be at least 1")
        need(self.batch_wait_ms >= 0, "--batch-wait must not be negative")
        need(self.queue_size >= 1, "--queue-size must be at least 1")
        need(self.request_timeout_s > 0, "--request-timeout must be positive")
        need(self.breaker_errors >= 1, "--breaker-errors must be at least 1")
        need(self.breaker_window_s > 0, "--breaker-window must be positive")
        need(self.breaker_cooldown_s >= 0, "--breaker-cooldown must not be negative")
        need(self.hang_after_s > 0, "--hang-after must be positive")
        need(self.max_connections >= 1, "--max-connections must be at least 1")
        for flag, v in (
            ("--idle-timeout", self.idle_timeout_s),
            ("--header-timeout", self.header_timeout_s),
            ("--body-timeout", self.body_timeout_s),
        ):
            need(v > 0, f"{flag} must be positive")
        need(self.double_bytes_per_token >= 0, "--double-bytes-per-token must not be negative")
        if self.ranks != 1:
            self._check_ranks(need)
        if self.perturb_control:
            self._check_admin(need)
        return self

    def _check_admin(self, need) -> None:  # type: ignore[no-untyped-def]
        need(bool(self.admin_token), "--perturb-control needs an admin token")
        need(
            self.allow_remote_admin or is_loopback(self.host),
            f"--host {self.host} with --perturb-control opens /admin/perturb to other "
            "machines: listen on 127.0.0.1, or add --allow-remote-admin",
        )

    def _check_cuda_mode(self, need) -> None:  # type: ignore[no-untyped-def]
        m = self.cuda_mode
        need(
            self.device in ("cpu-double", "cuda"),
            f"--cuda-mode {m} needs --device cpu-double (the libcuda TEST DOUBLE) or cuda",
        )
        # torch's CUDA allocator has no managed (cudaMallocManaged) mode.
        need(
            not (m == "managed" and self.device == "cuda"),
            "--cuda-mode managed: torch has no managed-memory allocator; "
            "use it with --device cpu-double",
        )
        need(self.ranks == 1, f"--cuda-mode {m} runs with --ranks 1 only")

    def _check_ranks(self, need) -> None:  # type: ignore[no-untyped-def]
        need(self.ranks == 2, f"--ranks {self.ranks}: give 1 or 2")
        need(self.rank in (0, 1), f"--rank {self.rank}: give 0 or 1")
        need(
            self.dist_backend in DIST_BACKENDS,
            f"--dist-backend {self.dist_backend}: choose one of {', '.join(DIST_BACKENDS)}",
        )
        if self.dist_backend == "nccl":
            need(self.device == "cuda", "--dist-backend nccl needs --device cuda (two GPUs)")
        else:
            need(
                self.device != "cuda",
                "--dist-backend gloo runs on the CPU: use --device cpu (or nccl with cuda)",
            )
        need(self.dist_timeout_s > 0, "--dist-timeout must be positive")
        need(0 <= self.master_port <= 65535, "--master-port: give 0..65535 (0 picks one)")
        need(
            self.rank == 0 or self.master_port != 0,
            "--rank 1 needs --master-port (rank 0 prints it: 'rendezvous on ADDR:PORT')",
        )
        need(0 <= self.metrics_port <= 65535, "--metrics-port: give 0..65535")
        need(
            self.n_heads % self.ranks == 0,
            f"--heads {self.n_heads} must be a multiple of --ranks {self.ranks} "
            "(attention heads are split across ranks)",
        )

    @property
    def bytes_per_token(self) -> int:
        """Activation bytes per token a batch allocates on the double."""
        return self.double_bytes_per_token or self.d_model * 4 * self.model_layers * 4


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; anything else (0.0.0.0, a name) may
    be reachable from other machines."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
