"""The reference inference service that gpufault's experiments run against.

A small causal transformer with seeded random weights (torch), a real
byte-level BPE tokenizer (HF `tokenizers`, trained in-process), a bounded
request queue with dynamic batching served by one named worker thread
("gf-worker"), load shedding, per-request timeouts, and a circuit breaker
that answers from a 1-layer fallback model (or with 503) after repeated
device errors. HTTP: `POST /v1/completions`, `GET /health`, `GET /metrics`.

Start it with `python -m pyctl.service --port 0` (or `gpufault service`).
docs/service.md describes the endpoints, metrics, device modes and breaker.

Modules, one job each:
    config     ServiceConfig: every knob, checked once
    tokenizer  the service's BPE tokenizer (encode goes through the Rust encode)
    model      TinyCausalLM: the transformer
    generate   batched greedy/temperature decoding over a model
    double     ctypes binding to the libcuda TEST DOUBLE
    device     cpu / cuda / cpu-double backends and their device errors
    breaker    the circuit breaker (closed / open / half-open)
    batcher    the bounded queue, request futures and the worker thread
    metrics    Prometheus metrics (prometheus_client)
    app        Service: wires the parts, answers requests, health
    server     the HTTP front end (stdlib ThreadingHTTPServer)
    cli        the click command `service`
  two ranks (`--ranks 2`, docs/service.md "Two ranks"):
    tp         tensor-parallel shards of TinyCausalLM (all_reduce per block half)
    dist       the process group's generations, collectives, DIST_* errors
    ranks      rank 0: the Service with the TP primary, heartbeat, re-formation
    follower   rank 1: its shard, its /metrics, following rank 0's broadcasts
"""

from __future__ import annotations

from pyctl.service.config import DEVICES, ServiceConfig

__all__ = ["DEVICES", "ServiceConfig"]
