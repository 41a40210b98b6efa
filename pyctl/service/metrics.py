"""The service's Prometheus metrics (prometheus_client, one registry per service).

Names and labels are listed in docs/service.md; experiments query them
with PromQL, for example
    histogram_quantile(0.99, rate(gf_service_request_duration_seconds_bucket[30s]))
    rate(gf_service_tokens_generated_total[30s])              # tokens/s
    gf_service_breaker_state                                 # 0 closed, 1 half-open, 2 open
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# From a 1 ms cache-hot answer to a 30 s timeout: experiments compare p99s
# from a few ms (CPU, tiny model) to seconds (a stalled worker).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.025,
    0.035,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.35,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    30.0,
)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _MemoryCollector(Collector):
    """gf_service_gpu_memory_used_bytes, read at scrape time from the backend."""

    def __init__(self, read: Callable[[], dict[str, float]], device: str) -> None:
        self.read, self.device = read, device

    def collect(self):  # type: ignore[no-untyped-def]
        values = self.read()
        if not values:
            return
        g = GaugeMetricFamily(
            "gf_service_gpu_memory_used_bytes",
            "Device memory in use (cuda: torch allocated/reserved and the device's used; "
            "cpu-double: what this service holds in the libcuda test double)",
            labels=["device", "kind"],
        )
        for kind, v in values.items():
            g.add_metric([self.device, kind], v)
        yield g


class _WorkerSeries:
    """What every rank's worker exports: its batches, its tokens, whether it
    runs and how long since it last made progress (rank 0 and rank 1 alike)."""

    def _add_worker_series(self, r: CollectorRegistry) -> None:
        self.tokens = Counter(
            "gf_service_tokens_generated_total",
            "Tokens generated (rate() gives tokens/s), by the model that made them",
            ["model"],
            registry=r,
        )
        self.batch_latency = Histogram(
            "gf_service_batch_duration_seconds",
            "Time to decode one batch, by model",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.worker_alive = Gauge(
            "gf_service_worker_alive", "1 while the worker thread runs", registry=r
        )
        self.worker_age = Gauge(
            "gf_service_worker_last_progress_age_seconds",
            "Seconds since the worker last made progress (grows while it hangs)",
            registry=r,
        )


class ServiceMetrics(_WorkerSeries):
    def __init__(self, device: str) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        self.info = Info("gf_service", "The reference inference service", registry=r)
        self._add_worker_series(r)
        self.request_latency = Histogram(
            "gf_service_request_duration_seconds",
            "Time from receiving a completion request to answering it",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "gf_service_requests_total",
            "Completion requests answered, by HTTP status and degradation",
            ["status", "degraded"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "gf_service_prompt_tokens_total", "Prompt tokens of answered requests", registry=r
        )
        self.errors = Counter(
            "gf_service_errors_total",
            "Errors by kind (device, timeout, shed, bad_request, rejected, internal) and code",
            ["kind", "code"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "gf_service_queue_depth", "Requests waiting for the worker", registry=r
        )
        self.queue_capacity = Gauge(
            "gf_service_queue_capacity", "Bound of the request queue", registry=r
        )
        self.batch_size = Histogram(
            "gf_service_batch_size", "Requests per batch", buckets=BATCH_BUCKETS, registry=r
        )
        self.breaker_state = Gauge(
            "gf_service_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", registry=r
        )
        self.breaker_transitions = Counter(
            "gf_service_breaker_transitions_total",
            "Circuit breaker state changes, by the state entered",
            ["to"],
            registry=r,
        )
        # --cuda-mode graph / managed (docs/service.md, "CUDA modes")
        self.graph_replays = Counter(
            "gf_service_graph_replays_total",
            "--cuda-mode graph: per-token CUDA graph replays (cuGraphLaunch) that succeeded",
            registry=r,
        )
        self.graph_fallbacks = Counter(
            "gf_service_graph_fallbacks_total",
            "--cuda-mode graph: batches finished with eager launches after a failed graph "
            "replay or capture, by CUresult",
            ["code"],
            registry=r,
        )
        self.prefetch_failures = Counter(
            "gf_service_managed_prefetch_failures_total",
            "--cuda-mode managed: failed prefetches of the managed activations, by CUresult "
            "(ignored: the pages migrate on first touch)",
            ["code"],
            registry=r,
        )
        self.device = device
        # Pre-create the label sets experiments alert on, so a query for
        # them finds 0 rather than nothing before the first error.
        for kind in ("device", "timeout", "shed", "bad_request", "rejected", "internal"):
            self.errors.labels(kind=kind, code="")
        for state in ("closed", "half-open", "open"):
            self.breaker_transitions.labels(to=state)
        for model in ("primary", "fallback"):
            self.tokens.labels(model=model)
        self.graph_fallbacks.labels(code="")
        self.prefetch_failures.labels(code="")

    def watch_memory(self, read: Callable[[], dict[str, float]]) -> None:
        self.registry.register(_MemoryCollector(read, self.device))

    def render(self) -> bytes:
        return generate_latest(self.registry)


# A collective on this tiny model takes tens of microseconds; a stall or a
# timeout takes milliseconds to seconds.
COLLECTIVE_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class DistMetrics:
    """The two-rank metrics, the same on both ranks (each on its own endpoint)."""

    def __init__(self, registry: CollectorRegistry, *, rank: int, world: int, backend: str) -> None:
        r = registry
        self.rank_info = Info("gf_service_rank", "This process's rank in the service", registry=r)
        self.rank_info.info({"rank": str(rank), "world_size": str(world), "backend": backend})
        self.collectives = Counter(
            "gf_service_dist_collectives_total",
            "Collectives this rank completed, by operation",
            ["op"],
            registry=r,
        )
        self.collective_latency = Histogram(
            "gf_service_dist_collective_duration_seconds",
            "Time this rank spent in one collective (issue to completion), by operation",
            ["op"],
            buckets=COLLECTIVE_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "gf_service_dist_errors_total",
            "Failed collectives and group formations, by code (DIST_TIMEOUT, DIST_ERROR)",
            ["code"],
            registry=r,
        )
        self.group_up = Gauge(
            "gf_service_dist_group_up", "1 while this rank's process group works", registry=r
        )
        self.generation = Gauge(
            "gf_service_dist_group_generation",
            "How many times the process group was formed (1 at start; +1 per re-formation)",
            registry=r,
        )
        for op in ("all_reduce", "broadcast"):
            self.collectives.labels(op=op)
        for code in ("DIST_TIMEOUT", "DIST_ERROR"):
            self.errors.labels(code=code)


class FollowerMetrics(_WorkerSeries):
    """Rank 1's own /metrics: it serves no requests, so only its worker,
    its batches and its collectives."""

    def __init__(self, *, world: int, backend: str, device: str) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        self.dist = DistMetrics(r, rank=1, world=world, backend=backend)
        self._add_worker_series(r)
        self.device = device
        self.tokens.labels(model="primary")

    def render(self) -> bytes:
        return generate_latest(self.registry)
