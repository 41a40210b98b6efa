"""Class 12: encoding-cache pollution and hot/cold skew.

Three phases against one tokenizer instance:
  before  hot requests only: texts from a fixed pool, drawn with Zipf
          weights, made of Zipf-distributed hot words
  during  the same hot requests interleaved with a flood of requests made
          of never-seen words (`flood_ratio` cold per hot)
  after   hot requests only again
Per phase: hot-request throughput and p50/p99 latency (the hot requests
alone, so the flood's own cost is not counted against them), and the
overall request rate during the flood. Verdicts compare medians, not p99,
because p99 on a shared 2-core machine is noise-prone:
  polluted  hot p50 during > factor x before
  sticky    hot p50 after  > factor x before (the flood's damage outlives it)

Cache capacity: HF `BPE(cache_capacity=N)` (default 10000 words in 0.23;
0 disables it). The HF cache stops inserting once full and never evicts,
so a flood that fills it leaves words first seen later uncached for
good; `sweep_hf_capacity` measures that. tiktoken 0.14 has no word cache
(every piece that is not a whole token goes through byte_pair_encode).
"""

from __future__ import annotations

import random
import string
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyctl.tokenizer.builders import build_hf_bpe, make_word
from pyctl.tokenizer.record import Recorder

PHASES = ("before", "during", "after")


def zipf_weights(n: int, s: float = 1.1) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def hot_pool(
    n_texts: int = 200, n_words: int = 500, words_per_text: int = 8, seed: int = 5
) -> list[str]:
    rng = random.Random(seed)
    vocab = sorted({make_word(rng, 2, 4) for _ in range(n_words * 2)})[:n_words]
    rng.shuffle(vocab)
    w = zipf_weights(len(vocab))
    return [" ".join(rng.choices(vocab, w, k=words_per_text)) for _ in range(n_texts)]


class ColdWords:
    """Never-seen words: random lowercase strings with a counter suffix
    spelled in letters, so no two are equal and none is in the hot pool."""

    def __init__(self, seed: int = 11) -> None:
        self.rng = random.Random(seed)
        self.n = 0

    def word(self) -> str:
        self.n += 1
        k, tag = self.n, ""
        while k:
            k, d = divmod(k, 26)
            tag += string.ascii_lowercase[d]
        return "".join(self.rng.choices("xqzjwvkyg", k=6)) + tag

    def text(self, words: int) -> str:
        return " ".join(self.word() for _ in range(words))


def pct(values: Sequence[int], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[min(len(s) - 1, int(q * len(s)))])


@dataclass
class PhaseStats:
    phase: str
    hot_requests: int
    hot_p50_us: float
    hot_p99_us: float
    hot_per_s: float
    all_per_s: float
    hit_ratio: float | None = None  # only for targets that count hits


@dataclass
class CacheReport:
    target: str
    phases: list[PhaseStats] = field(default_factory=list)
    factor: float = 2.0

    def stat(self, phase: str) -> PhaseStats:
        return next(p for p in self.phases if p.phase == phase)

    @property
    def during_ratio(self) -> float:
        return self.stat("during").hot_p50_us / max(self.stat("before").hot_p50_us, 1e-9)

    @property
    def after_ratio(self) -> float:
        return self.stat("after").hot_p50_us / max(self.stat("before").hot_p50_us, 1e-9)

    @property
    def polluted(self) -> bool:
        return self.during_ratio > self.factor

    @property
    def sticky(self) -> bool:
        return self.after_ratio > self.factor


def run_cache(
    target: Any,
    *,
    requests: int = 1500,
    flood_ratio: int = 4,
    words_per_request: int = 8,
    pool: Sequence[str] | None = None,
    factor: float = 2.0,
    seed: int = 1,
    warmup: bool = True,
    recorder: Recorder | None = None,
    progress: Callable[[int], None] | None = None,
) -> CacheReport:
    texts = list(pool) if pool is not None else hot_pool(words_per_text=words_per_request)
    rng = random.Random(seed)
    weights = zipf_weights(len(texts))
    cold = ColdWords(seed + 1)
    rep = CacheReport(getattr(target, "name", "?"), factor=factor)
    if warmup:
        # Every hot text once, so "before" measures a warm cache.
        for t in texts:
            target.encode(t)
    clock = time.perf_counter_ns
    for phase in PHASES:
        hot_lat: list[int] = []
        n_all = 0
        h0 = getattr(target, "hits", None)
        m0 = getattr(target, "misses", None)
        t_phase = clock()
        for i in range(requests):
            if phase == "during":
                for _ in range(flood_ratio):
                    target.encode(cold.text(words_per_request))
                    n_all += 1
            text = texts[rng.choices(range(len(texts)), weights)[0]]
            t0 = clock()
            target.encode(text)
            hot_lat.append(clock() - t0)
            n_all += 1
            if progress and i % 100 == 99:
                progress(100)
        wall = (clock() - t_phase) / 1e9
        hit_ratio = None
        if h0 is not None and m0 is not None:
            dh = target.hits - h0
            dm = target.misses - m0
            # Hits can only come from hot requests (cold texts are unique).
            hit_ratio = dh / len(hot_lat) if (dh + dm) else None
        st = PhaseStats(
            phase,
            len(hot_lat),
            pct(hot_lat, 0.50) / 1e3,
            pct(hot_lat, 0.99) / 1e3,
            len(hot_lat) / (sum(hot_lat) / 1e9),
            n_all / wall,
            hit_ratio,
        )
        rep.phases.append(st)
        if recorder is not None:
            recorder.add(
                f"phase:{phase}",
                "\n".join(texts) if phase == "before" else f"<{phase}: {n_all} requests>",
                "polluted"
                if phase != "before" and st.hot_p50_us > factor * rep.phases[0].hot_p50_us
                else "ok",
                latency_ns=int(st.hot_p50_us * 1e3),
                details=st.__dict__,
            )
    if recorder is not None:
        recorder.flush()
    return rep


def sweep_hf_capacity(
    capacities: Sequence[int] = (0, 100, 10_000), **kw: Any
) -> dict[int, CacheReport]:
    """The same workload against HF BPEs that differ only in cache capacity."""
    # lazy: pyctl.tokenizer.targets (base64, calendar, +31 modules) only when this runs
    from pyctl.tokenizer.targets import HFTarget

    out = {}
    for cap in capacities:
        t = HFTarget(build_hf_bpe(1000, cache_capacity=cap), name=f"hf(cache={cap})")
        out[cap] = run_cache(t, **kw)
    return out
