"""Class 11: tokenizer thread safety.

N threads share one tokenizer instance and encode the same inputs in
different orders, released together by a barrier; every output is compared
with a single-threaded reference computed first. A mismatch is reported
with the input (hash, or text with --keep-text), the thread and the ids.

Race amplification in-process: a short GIL switch interval, and for
targets that wrap an inner tokenizer (`.inner`) a per-thread stall right
after the inner encode returns, the in-process form of a probe-point stall
(the BPF/copilot stall on `hf-bpe-tokenize` or `tiktoken-bpe` does the same
inside the native code of another process).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyctl.tokenizer.builders import generate_corpus
from pyctl.tokenizer.record import Recorder


def default_inputs(n: int = 16, seed: int = 7) -> list[str]:
    """A few distinct texts of varied length; repeats come from the schedule."""
    lines = generate_corpus(n * 4, seed=seed)
    return [" ".join(lines[i * 4 : i * 4 + 1 + (i % 4)]) for i in range(n)]


@dataclass
class Mismatch:
    thread: int
    index: int
    got: list[int]
    want: list[int]


@dataclass
class RaceReport:
    target: str
    threads: int
    calls: int = 0
    errors: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    per_input: dict[int, int] = field(default_factory=dict)  # index -> mismatches
    seconds: float = 0.0
    fault_ids: list[str] = field(default_factory=list)


class _Stall:
    """Wrap `inner.encode` so chosen threads stall after it returns."""

    def __init__(self, inner: Any, stall_s: float, stalled: set[int]) -> None:
        self.inner = inner
        self.orig = inner.encode
        self.stall_s = stall_s
        self.stalled = stalled

    def __enter__(self) -> None:
        orig, stall_s, stalled = self.orig, self.stall_s, self.stalled

        def encode(text: str) -> list[int]:
            ids = orig(text)
            if threading.get_ident() in stalled:
                time.sleep(stall_s)
            return list(ids)

        self.inner.encode = encode

    def __exit__(self, *exc: object) -> None:
        self.inner.encode = self.orig


def run_race(
    target: Any,
    inputs: Sequence[str] | None = None,
    *,
    threads: int = 8,
    calls_per_thread: int = 200,
    stall_us: int = 0,
    switch_interval_s: float = 1e-5,
    seed: int = 1,
    recorder: Recorder | None = None,
    progress: Callable[[int], None] | None = None,
) -> RaceReport:
    texts = list(inputs) if inputs is not None else default_inputs()
    if not texts:
        raise ValueError("no inputs")
    if threads < 2:
        raise ValueError("threads must be >= 2 for a race")
    # The reference: one thread, before any sharing.
    reference = [list(target.encode(t)) for t in texts]
    rep = RaceReport(getattr(target, "name", "?"), threads)
    lock = threading.Lock()
    barrier = threading.Barrier(threads)
    stalled: set[int] = set()

    def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        order = [rng.randrange(len(texts)) for _ in range(calls_per_thread)]
        if k % 2 == 1:
            stalled.add(threading.get_ident())
        barrier.wait()
        local: list[Mismatch] = []
        errors = 0
        for i in order:
            try:
                got = list(target.encode(texts[i]))
            except Exception:
                errors += 1
                continue
            if got != reference[i]:
                local.append(Mismatch(k, i, got, reference[i]))
        with lock:
            rep.mismatches.extend(local)
            rep.calls += len(order)
            rep.errors += errors
        if progress:
            progress(1)

    inner = getattr(target, "inner", None)
    stall_ctx = _Stall(inner, stall_us / 1e6, stalled) if stall_us and inner is not None else None
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_s)
    t0 = time.perf_counter()
    try:
        if stall_ctx:
            stall_ctx.__enter__()
        pool = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
    finally:
        if stall_ctx:
            stall_ctx.__exit__(None, None, None)
        sys.setswitchinterval(old_interval)
    rep.seconds = time.perf_counter() - t0
    for m in rep.mismatches:
        rep.per_input[m.index] = rep.per_input.get(m.index, 0) + 1
    if recorder is not None:
        for i, text in enumerate(texts):
            n = rep.per_input.get(i, 0)
            first = next((m for m in rep.mismatches if m.index == i), None)
            details: dict[str, Any] = {"index": i, "mismatches": n, "threads": threads}
            if first is not None:
                details.update(
                    thread=first.thread,
                    got_len=len(first.got),
                    want_len=len(first.want),
                    got_head=first.got[:16],
                    want_head=first.want[:16],
                )
            rep.fault_ids.append(
                recorder.add("shared-instance", text, "mismatch" if n else "ok", details=details)
            )
        recorder.flush()
    return rep
