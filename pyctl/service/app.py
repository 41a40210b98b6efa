"""Service: the tokenizer, the two models, the device, the breaker, the
worker and the metrics, wired together; transport-independent (server.py
only moves bytes).

Request path (an HTTP thread): validate -> tokenizer.encode (the real Rust
encode) -> submit to the bounded queue (429 when full) -> wait for the
answer until the request's deadline (504 after it).
Batch path (the worker thread): breaker closed or half-open -> the primary
model on the device backend; a device error counts against the breaker and
the batch is answered by the degradation path: the 1-layer fallback model
on the host CPU ("degraded": true) or 503, as configured.
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pyctl.service.batcher import Outcome, Pending, QueueFull, Worker, error_body
from pyctl.service.breaker import CLOSED, OPEN, STATE_VALUE, CircuitBreaker
from pyctl.service.config import ServiceConfig
from pyctl.service.device import CudaGraphStep, DeviceError, make_backend
from pyctl.service.generate import GenRequest, generate
from pyctl.service.metrics import ServiceMetrics
from pyctl.service.model import TinyCausalLM, build_model
from pyctl.service.perturb import PerturbControl
from pyctl.service.tokenizer import ServiceTokenizer

MAX_TEMPERATURE = 2.0


class BadRequest(ValueError):
    pass


def log(msg: str) -> None:
    print(f"gf-service: {msg}", file=sys.stderr, flush=True)


class Service:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg.check()
        torch.set_num_threads(cfg.torch_threads)
        self.tok = ServiceTokenizer(cfg.vocab_size)
        vocab = self.tok.vocab_size

        def model(layers: int, seed: int) -> TinyCausalLM:
            return build_model(
                vocab_size=vocab,
                d_model=cfg.d_model,
                n_heads=cfg.n_heads,
                max_context=cfg.max_context,
                n_layers=layers,
                seed=seed,
            )

        # Built on the CPU here; moved to the device in the worker thread.
        self.primary = model(cfg.model_layers, cfg.seed)
        # The fallback lives on the host CPU: it must work when the device does not.
        self.fallback = model(cfg.fallback_layers, cfg.seed + 1)
        self.primary_name = f"gf-tiny-{cfg.model_layers}l"
        self.fallback_name = f"gf-tiny-{cfg.fallback_layers}l-fallback"
        self.perturb: PerturbControl | None = None
        if cfg.perturb_control:
            # cfg.check() made sure there is a token (pyctl/service/perturb.py).
            self.perturb = PerturbControl(cfg.admin_token or "", log=log)
            self.perturb.bind(self.primary)
        # graph mode's static buffer on the double: a full context's activations.
        self.backend = make_backend(
            cfg.device,
            # cuda: only an explicit --double-bytes-per-token (a KV-cache-like scratch)
            cfg.bytes_per_token if cfg.device != "cuda" else cfg.double_bytes_per_token,
            mode=cfg.cuda_mode,
            static_bytes=cfg.bytes_per_token * cfg.max_context,
        )
        self.backend.on_event = self._device_event
        self._graph_step: CudaGraphStep | None = None  # --device cuda --cuda-mode graph
        self._logged: set[str] = set()
        self.metrics = m = ServiceMetrics(cfg.device if cfg.device != "cuda" else "cuda:0")
        self.breaker = CircuitBreaker(
            cfg.breaker_errors,
            cfg.breaker_window_s,
            cfg.breaker_cooldown_s,
            on_change=self._breaker_changed,
        )
        self.worker = Worker(
            self._run_batch,
            max_batch=cfg.max_batch,
            batch_wait_s=cfg.batch_wait_ms / 1000.0,
            queue_size=cfg.queue_size,
            on_start=self._worker_start,
            on_expired=lambda p: None,
        )
        self._ids = itertools.count(1)
        self._batch: list[Pending] | None = None  # the worker's batch, if it streams
        self._seed_base = cfg.seed * 1_000_003
        self.started_at = time.monotonic()
        m.info.info(
            {
                "device": cfg.device,
                "model": self.primary_name,
                "fallback": self.fallback_name,
                "degrade": cfg.degrade,
                "cuda_mode": cfg.cuda_mode,
                "libcuda_test_double": str(self.backend.double).lower(),
            }
        )
        m.queue_capacity.set(cfg.queue_size)
        m.queue_depth.set_function(self.worker.depth)
        m.worker_alive.set_function(lambda: float(self.worker.alive()))
        m.worker_age.set_function(self.worker.progress_age)
        m.breaker_state.set_function(lambda: STATE_VALUE[self.breaker.state])
        m.watch_memory(self.backend.memory)

    # ---- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()

    def _worker_start(self) -> None:
        """In the worker thread: the device (contexts are per thread) and a warm-up."""
        self.backend.open()
        self.primary.to(self.backend.torch_device)
        warm = [GenRequest(self.tok.encode("warm up"), 1)]
        generate(self.primary, warm, pad_id=self.tok.pad_id, device=self.backend.torch_device)
        generate(self.fallback, warm, pad_id=self.tok.pad_id)
        if self.cfg.cuda_mode == "graph" and self.cfg.device == "cuda":
            try:
                self._graph_step = CudaGraphStep(
                    self.primary, self.cfg.max_batch, self.cfg.max_context, self._device_event
                )
            except RuntimeError as e:  # e.g. a failed cudaGraphInstantiate: serve eagerly
                self._device_event("graph_fallback", "CUDA_ERROR_OTHER")
                log(f"CUDA graph capture failed ({str(e).splitlines()[0]}): decoding eagerly")

    def _device_event(self, event: str, code: str) -> None:
        """What --cuda-mode graph / managed report from the worker thread."""
        m = self.metrics
        if event == "graph_replay":
            m.graph_replays.inc()
            return
        if event == "graph_fallback":
            m.graph_fallbacks.labels(code=code).inc()
            what = "CUDA graph replay failed; batches fall back to eager launches"
        else:
            m.prefetch_failures.labels(code=code).inc()
            what = "managed-memory prefetch failed; ignored (pages migrate on first touch)"
        if event not in self._logged:  # once: the counters say how often
            self._logged.add(event)
            log(f"{what} ({code}; counted in /metrics)")

    # ---- the request path (HTTP threads) -------------------------------------
    def complete(self, body: Any, t0: float | None = None, *, chat: bool = False) -> Outcome:
        """Answer one /v1/completions body (or a /v1/chat/completions one:
        chat), already JSON-decoded, or a BadRequest's message string, as
        one JSON answer (a `stream` request is refused here: open() streams
        it). Records latency and counters."""
        t0 = time.monotonic() if t0 is None else t0
        out = self._opened(body, t0, chat, streaming=False)
        assert isinstance(out, Outcome)
        return self._count(out, t0)

    def open(self, body: Any, t0: float | None = None, *, chat: bool = False) -> Outcome | Stream:
        """Like complete(), but a request with "stream": true whose first
        token arrives is answered by a Stream (its chunks, token by token;
        counted when it ends); a refusal or an error before the first token
        is an Outcome, counted here."""
        t0 = time.monotonic() if t0 is None else t0
        out = self._opened(body, t0, chat, streaming=True)
        return self._count(out, t0) if isinstance(out, Outcome) else out

    def _count(self, out: Outcome, t0: float) -> Outcome:
        degraded = bool(out.body.get("degraded", False))
        self._observe(out.status, degraded, t0)
        return out

    def _observe(self, status: int, degraded: bool, t0: float) -> None:
        label = _outcome_label(Outcome(status, {}), degraded)
        self.metrics.request_latency.labels(outcome=label).observe(time.monotonic() - t0)
        self.metrics.requests.labels(status=str(status), degraded=str(degraded).lower()).inc()

    def bad_request(self, message: str, t0: float) -> Outcome:
        """For the transport's own 400s (invalid JSON, no body): counted the same way."""
        return self.complete(BadRequest(message), t0)

    def refused(self, status: int, message: str, t0: float) -> Outcome:
        """The transport's 408 (a body too slow) and 413 (too large): counted
        as requests of that status and as errors of that kind."""
        kind = "request_timeout" if status == 408 else "invalid_request_error"
        out = Outcome(status, error_body(kind, message))
        self.metrics.errors.labels(kind="bad_request", code=str(status)).inc()
        self.metrics.request_latency.labels(outcome=_outcome_label(out, False)).observe(
            time.monotonic() - t0
        )
        self.metrics.requests.labels(status=str(status), degraded="false").inc()
        return out

    def _opened(self, body: Any, t0: float, chat: bool, *, streaming: bool) -> Outcome | Stream:
        try:
            if isinstance(body, BadRequest):
                raise body
            req = self._validate(body, chat)
            if req.stream and not streaming:
                raise BadRequest("'stream' is not supported here: leave it out or set it false")
            try:
                ids = self.tok.encode(req.prompt)
            except (TypeError, ValueError) as e:
                # HF tokenizers refuses a str holding lone surrogates (JSON
                # "\ud800" decodes to one) with TypeError; unanswered, the
                # HTTP thread died and the client saw a dropped connection
                # (found by the unicode-adversarial experiment).
                raise BadRequest(
                    f"the prompt cannot be tokenized ({str(e).splitlines()[0]}): "
                    "send valid Unicode (no lone surrogates)"
                ) from None
            room = self.cfg.max_context - req.max_tokens
            if len(ids) > room:
                raise BadRequest(
                    f"prompt is {len(ids)} tokens; with max_tokens {req.max_tokens} that exceeds "
                    f"the context length {self.cfg.max_context}: shorten the prompt"
                )
        except BadRequest as e:
            self.metrics.errors.labels(kind="bad_request", code="").inc()
            return Outcome(400, error_body("invalid_request_error", str(e)))
        n = next(self._ids)
        p = Pending(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            ids=ids,
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            seed=self._seed_base + n,
            deadline=t0 + self.cfg.request_timeout_s,
            stream=queue.SimpleQueue() if req.stream else None,
        )
        try:
            self.worker.submit(p)
        except QueueFull:
            self.metrics.errors.labels(kind="shed", code="queue_full").inc()
            return Outcome(
                429,
                error_body(
                    "overloaded",
                    f"queue full ({self.cfg.queue_size} requests waiting): retry later",
                ),
                {"Retry-After": "1"},
            )
        if p.stream is not None:
            try:
                first = p.stream.get(timeout=max(0.0, p.deadline - time.monotonic()))
            except queue.Empty:
                first = None
            if first is not None:
                return Stream(self, p, first, req, t0)
        if not p.done.wait(max(0.0, p.deadline - time.monotonic())):
            return self._timed_out(p)
        assert p.outcome is not None
        if p.stream is not None and p.outcome.status == 200:
            # Answered without a token streamed (a decode path that does not
            # emit them): still a stream, its text in one chunk.
            return Stream(self, p, None, req, t0)
        return _chat_body(p.outcome) if chat else p.outcome

    def _timed_out(self, p: Pending) -> Outcome:
        self.metrics.errors.labels(kind="timeout", code="").inc()
        p.finish(Outcome(504, {}))  # the worker skips it if it has not started it
        return Outcome(
            504,
            error_body(
                "timeout",
                f"no answer within the request timeout of {self.cfg.request_timeout_s:g} s",
            ),
        )

    def _validate(self, body: Any, chat: bool = False) -> Request:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        prompt: Any
        if chat:
            prompt = chat_prompt(body.get("messages"))
        else:
            prompt = body.get("prompt")
            if prompt is None:
                raise BadRequest("missing 'prompt': give a string")
            if not isinstance(prompt, str):
                raise BadRequest("'prompt' must be a string (lists of prompts are not supported)")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false")
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not stream):
            raise BadRequest("'stream_options' must be an object, and only with 'stream': true")
        usage = bool((opts or {}).get("include_usage", False))
        if body.get("n", 1) != 1:
            raise BadRequest("'n' must be 1")
        lim = self.cfg.max_tokens_limit
        mt = body.get("max_tokens", self.cfg.default_max_tokens)
        if chat and "max_completion_tokens" in body:
            mt = body["max_completion_tokens"]
        if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= lim:
            raise BadRequest(f"'max_tokens' must be a whole number from 1 to {lim}")
        temp = body.get("temperature", 0.0)
        if temp is None:
            temp = 0.0
        if (
            isinstance(temp, bool)
            or not isinstance(temp, (int, float))
            or not (0.0 <= temp <= MAX_TEMPERATURE)
        ):
            raise BadRequest(f"'temperature' must be a number from 0 to {MAX_TEMPERATURE:g}")
        return Request(prompt, mt, float(temp), stream, usage, chat)

    # ---- the batch path (the worker thread) ------------------------------------
    def _run_batch(self, batch: list[Pending]) -> None:
        # Streamed requests of this batch get each step's tokens (_emit).
        self._batch = batch if any(p.stream is not None for p in batch) else None
        m = self.metrics
        m.batch_size.observe(len(batch))
        reqs = [GenRequest(p.ids, p.max_tokens, p.temperature, p.seed) for p in batch]
        n_tokens = sum(len(r.ids) + r.max_tokens for r in reqs)
        failure: DeviceError | None = None
        if self.cfg.degrade == "off":
            self._run_unguarded(batch, reqs, n_tokens)
            return
        if self.breaker.use_primary():
            t = time.monotonic()
            try:
                outs = self.backend.run_batch(
                    lambda hook: self._primary_decode(reqs, hook),
                    n_tokens,
                )
            except DeviceError as e:
                failure = e
                m.errors.labels(kind="device", code=e.code).inc()
                self.breaker.failure(f"{e.call or 'device'}: {e.code}")
            else:
                self.breaker.success()
                m.batch_latency.labels(model="primary").observe(time.monotonic() - t)
                self._answer(batch, outs, degraded=False)
                return
        self._degrade(batch, reqs, failure)

    def _run_unguarded(self, batch: list[Pending], reqs: list[GenRequest], n_tokens: int) -> None:
        """--degrade off: the primary model every time, its device error a
        500 for the batch's requests. The breaker is never consulted (it
        stays closed), so nothing shields the requests after the error."""
        m = self.metrics
        t = time.monotonic()
        try:
            outs = self.backend.run_batch(lambda hook: self._primary_decode(reqs, hook), n_tokens)
        except DeviceError as e:
            m.errors.labels(kind="device", code=e.code).inc()
            msg = f"device error: {e.code} ({e.call or 'device'})"
            for p in batch:
                p.finish(Outcome(500, error_body("device_error", msg)))
            return
        m.batch_latency.labels(model="primary").observe(time.monotonic() - t)
        self._answer(batch, outs, degraded=False)

    def _primary_decode(self, reqs: list[GenRequest], hook: Any) -> list[list[int]]:
        if self.perturb is None:
            return self._decode(self.primary, reqs, self.backend.torch_device, hook)
        with self.perturb.around(self.primary):  # flips only while armed
            return self._decode(self.primary, reqs, self.backend.torch_device, hook)

    def _degrade(
        self, batch: list[Pending], reqs: list[GenRequest], failure: DeviceError | None
    ) -> None:
        if self.cfg.degrade == "fallback":
            t = time.monotonic()
            outs = self._decode(self.fallback, reqs, "cpu", None)
            self.metrics.batch_latency.labels(model="fallback").observe(time.monotonic() - t)
            self._answer(batch, outs, degraded=True)
            return
        snap = self.breaker.snapshot()
        if failure is not None:
            msg = f"device error: {failure.code} ({failure.call or 'device'}); retry later"
        else:
            msg = (
                f"service degraded: circuit breaker open after {self.cfg.breaker_errors} "
                f"consecutive device errors (last: {snap.last_error}); retry later"
            )
        retry = max(1, int(self.cfg.breaker_cooldown_s + 0.999))
        for p in batch:
            self.metrics.errors.labels(kind="rejected", code="breaker_" + snap.state).inc()
            p.finish(
                Outcome(503, error_body("service_unavailable", msg), {"Retry-After": str(retry)})
            )

    def _decode(
        self, model: TinyCausalLM, reqs: list[GenRequest], device: str, hook: Any
    ) -> list[list[int]]:
        def on_step(step: int) -> None:
            self.worker.beat()  # progress: a long batch is not a hung worker
            if hook is not None:
                hook(step)

        graph = self._graph_step if model is self.primary else None
        if graph is not None:
            graph.begin_batch()
        return generate(
            model,
            reqs,
            pad_id=self.tok.pad_id,
            banned=self.tok.special_ids,
            device=device,
            on_step=on_step,
            forward=graph,
            on_tokens=self._emit if self._batch is not None else None,
        )

    def _emit(self, step: int, chosen: list[int]) -> None:
        """generate()'s per-step tokens to the batch's streamed requests."""
        for p, tok in zip(self._batch or (), chosen, strict=False):
            p.emit(step, tok)

    def _answer(self, batch: list[Pending], outs: list[list[int]], *, degraded: bool) -> None:
        model = self.fallback_name if degraded else self.primary_name
        label = "fallback" if degraded else "primary"
        now = int(time.time())
        for p, ids in zip(batch, outs, strict=True):
            self.metrics.tokens.labels(model=label).inc(len(ids))
            self.metrics.prompt_tokens.inc(len(p.ids))
            p.finish(
                Outcome(
                    200,
                    {
                        "id": p.id,
                        "object": "text_completion",
                        "created": now,
                        "model": model,
                        "choices": [
                            {
                                "index": 0,
                                "text": self.tok.decode(ids),
                                "finish_reason": "length",
                                "logprobs": None,
                            }
                        ],
                        "usage": {
                            "prompt_tokens": len(p.ids),
                            "completion_tokens": len(ids),
                            "total_tokens": len(p.ids) + len(ids),
                        },
                        "degraded": degraded,
                    },
                )
            )

    def _breaker_changed(self, old: str, new: str) -> None:
        self.metrics.breaker_transitions.labels(to=new).inc()
        why = f" (last error: {self.breaker._last_error})" if new == OPEN else ""
        log(f"circuit breaker {old} -> {new}{why}")

    # ---- health -------------------------------------------------------------
    def health(self) -> tuple[int, dict[str, Any]]:
        snap = self.breaker.snapshot()
        alive = self.worker.alive()
        age = self.worker.progress_age()
        hung = age > self.cfg.hang_after_s
        reasons = []
        if not alive:
            reasons.append("worker thread is not running")
        elif hung:
            reasons.append(f"worker made no progress for {age:.1f} s (> {self.cfg.hang_after_s:g})")
        if snap.state == OPEN and self.cfg.degrade == "reject":
            reasons.append("circuit breaker open and --degrade reject: completions get 503")
        if reasons:
            status = "unhealthy"
        elif snap.state != CLOSED:
            status = "degraded"
            reasons.append(f"circuit breaker {snap.state}: answers come from {self.fallback_name}")
        else:
            status = "ok"
        busy = self.worker.busy_since
        body = {
            "status": status,
            "reasons": reasons,
            "device": self.cfg.device,
            "libcuda_test_double": self.backend.double,
            "model": self.primary_name,
            "fallback": self.fallback_name,
            "degrade": self.cfg.degrade,
            "cuda_mode": self.cfg.cuda_mode,
            "breaker": {
                "state": snap.state,
                "consecutive_errors": snap.consecutive_errors,
                "threshold": self.cfg.breaker_errors,
                "trips": snap.trips,
                "open_for_s": snap.opened_for_s,
                "last_error": snap.last_error,
            },
            "queue": {"depth": self.worker.depth(), "capacity": self.cfg.queue_size},
            "worker": {
                "alive": alive,
                "name": self.worker.thread.name,
                "tid": self.worker.tid,
                "last_progress_age_s": round(age, 3),
                "busy_for_s": None if busy is None else round(time.monotonic() - busy, 3),
                "hung": hung,
            },
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self.started_at, 3),
        }
        return (503 if status == "unhealthy" else 200), body


def _outcome_label(out: Outcome, degraded: bool) -> str:
    if out.status == 200:
        return "degraded" if degraded else "ok"
    return {400: "bad_request", 429: "shed", 503: "rejected", 504: "timeout"}.get(
        out.status, "error"
    )


@dataclass(frozen=True)
class Request:
    """A validated completion or chat request."""

    prompt: str
    max_tokens: int
    temperature: float
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last usage chunk
    chat: bool = False


def chat_prompt(messages: Any) -> str:
    """A chat's messages as the model's prompt: one "role: content" line
    per message, then "assistant:" (a plain template: the tiny model was
    never trained on chat, any fixed template serves)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("missing 'messages': give a list of {role, content} objects")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(
                f"messages[{i}] must be an object with a role of {', '.join(ROLES)} and content"
            )
        c = m.get("content")
        if isinstance(c, list):  # content parts: the text ones
            if not all(isinstance(x, dict) and isinstance(x.get("text"), str) for x in c):
                raise BadRequest(f"messages[{i}].content parts must be {{type: text, text}}")
            c = "".join(x["text"] for x in c)
        if not isinstance(c, str):
            raise BadRequest(f"messages[{i}].content must be a string")
        lines.append(f"{m['role']}: {c}")
    return "\n".join([*lines, "assistant:"])


ROLES = ("system", "user", "assistant", "developer", "tool")


def _chat_body(out: Outcome) -> Outcome:
    """A completion's 200 body in chat.completion's shape (errors as they are)."""
    if out.status != 200:
        return out
    b = out.body
    ch = b["choices"][0]
    return Outcome(
        200,
        {
            **b,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ch["text"]},
                    "finish_reason": ch["finish_reason"],
                    "logprobs": None,
                }
            ],
        },
        out.headers,
    )


class Stream:
    """A streamed answer after its first token: chunks() yields the
    OpenAI chunk objects (text_completion, or chat.completion.chunk with
    delta.content), one per token as the worker makes it, then the last
    one with finish_reason (and, with stream_options.include_usage, a usage
    chunk); an error after the first token (the request timed out, the
    device failed with --degrade reject) is a last {"error": ...} chunk.
    Counted in the metrics when it ends."""

    def __init__(
        self, svc: Service, p: Pending, first: int | None, req: Request, t0: float
    ) -> None:
        self.svc, self.p, self.first, self.req, self.t0 = svc, p, first, req, t0
        self.created = int(time.time())

    def _chunk(self, text: str | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
        if self.req.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update({"logprobs": None, "finish_reason": finish})
        return {
            "id": self.p.id,
            "object": "chat.completion.chunk" if self.req.chat else "text_completion",
            "created": self.created,
            "model": self.svc.primary_name,
            "choices": [choice],
            **extra,
        }

    def chunks(self) -> Iterator[dict[str, Any]]:
        p, svc = self.p, self.svc
        assert p.stream is not None
        ids: list[int] = []
        shown = ""
        tok: int | None = self.first
        if self.req.chat:  # the role comes first, as OpenAI sends it
            first = self._chunk("")
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield first
        status = 200
        try:
            while tok is not None:
                ids.append(tok)
                text = svc.tok.decode(ids)
                # A byte-level BPE token can end inside a character: hold it back.
                if not text.endswith("\ufffd") and len(text) > len(shown):
                    yield self._chunk(text[len(shown) :])
                    shown = text
                left = p.deadline - time.monotonic()
                try:
                    tok = p.stream.get(timeout=max(0.0, left))
                except queue.Empty:
                    late = svc._timed_out(p)
                    status = late.status
                    yield late.body
                    return
            out = p.outcome
            assert out is not None
            if out.status != 200:
                status = out.status
                yield out.body
                return
            degraded = bool(out.body.get("degraded", False))
            usage = out.body["usage"]
            text = svc.tok.decode(ids) if ids else str(out.body["choices"][0]["text"])
            tail = text[len(shown) :] if len(text) > len(shown) else None
            model = out.body.get("model", svc.primary_name)
            last = self._chunk(tail if tail or not self.req.chat else None, "length")
            last.update({"model": model, "degraded": degraded})
            yield last
            if self.req.include_usage:
                u = self._chunk(None)
                u.update({"choices": [], "usage": usage, "model": model})
                yield u
        finally:
            d = bool(p.outcome is not None and p.outcome.body.get("degraded", False))
            svc._observe(status, d, self.t0)
