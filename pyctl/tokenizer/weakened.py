"""Deliberately weakened tokenizer wrappers: each has the one defect its
campaign is designed to find. They wrap a real tokenizer (a Target) and
exist so tests and demos can show that a campaign finds what it should
and stays quiet on the sound, unwrapped target. Never use them for work.
"""

from __future__ import annotations

import time
import unicodedata
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


class WeakLossyTokenizer:
    """For the Unicode campaign (class 9). Three defects of hand-written
    pre-processing: it drops zero-width and format characters (round-trip
    loss), indexes a 0x10000-entry table with ord(c) (IndexError on astral
    noncharacters and emoji), and de-duplicates runs with a quadratic scan
    (superlinear time on long repeated pieces)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = f"weak-lossy({inner.name})"
        self.specials = inner.specials
        self._table = [0] * 0x10000

    def encode(self, text: str) -> list[int]:
        kept = "".join(c for c in text if unicodedata.category(c) != "Cf")
        for c in kept[:64]:
            self._table[ord(c)] += 1  # IndexError above U+FFFF
        if len(kept) >= 4096 and len(set(kept[:256])) == 1:
            # "collapse repeats": count every 4th 8-char window over the whole
            # text, O(n^2 / 4) on long repeated pieces.
            for i in range(0, len(kept), 4):
                kept.count(kept[i : i + 8])
        return self.inner.encode(kept)

    def decode(self, ids: Sequence[int]) -> str | None:
        return self.inner.decode(ids)


class WeakUnsyncCacheTokenizer:
    """For the thread-safety campaign (class 11). A one-entry memo kept in
    two attributes written at different times, with no lock: a thread can
    pair another thread's text with its own ids. The window is the inner
    encode (tiktoken releases the GIL there); `stall_s` widens it the way a
    probe-point stall would."""

    def __init__(self, inner: Any, stall_s: float = 0.0) -> None:
        self.inner = inner
        self.name = f"weak-unsync-cache({inner.name})"
        self.specials = inner.specials
        self.stall_s = stall_s
        self._last_text: str | None = None
        self._last_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        if text == self._last_text:
            return list(self._last_ids)
        self._last_text = text
        ids = self.inner.encode(text)
        if self.stall_s:
            time.sleep(self.stall_s)
        self._last_ids = ids
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str | None:
        return self.inner.decode(ids)


class WeakOffByOneCollator:
    """For the truncation campaign (class 10). Pads and truncates like a
    hand-written collator with two bugs: the attention mask is built from
    the length before truncation (so a text longer than max_length gets a
    mask of ones over the padding it never had... and a mask longer than
    the ids), and left truncation keeps the head instead of the tail."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = f"weak-collator({inner.name})"
        self.specials = inner.specials

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids: Sequence[int]) -> str | None:
        return self.inner.decode(ids)

    def collate(
        self, texts: Sequence[str], max_length: int, side: str, pad_id: int, truncate_side: str
    ) -> list[tuple[list[int], list[int]]]:
        out = []
        for t in texts:
            ids = self.inner.encode(t)
            n = len(ids)
            cut = ids[:max_length]  # bug: ignores truncate_side
            mask = [1] * min(n, max_length + 1)  # bug: off by one past the limit
            pad = max_length - len(cut)
            if side == "right":
                out.append((cut + [pad_id] * pad, mask + [0] * max(0, max_length - len(mask))))
            else:
                out.append(([pad_id] * pad + cut, [0] * max(0, max_length - len(mask)) + mask))
        return out


class WeakLruCacheTokenizer:
    """For the cache campaign (class 12). An LRU word cache of `capacity`
    entries in front of an expensive uncached encode: a flood of
    never-seen words evicts the hot words, so hot-word latency rises
    during the flood. With capacity=0 there is no cache (no skew)."""

    def __init__(self, inner: Any, capacity: int = 256, miss_cost_s: float = 0.0) -> None:
        self.inner = inner
        self.name = f"weak-lru({inner.name},{capacity})"
        self.specials = inner.specials
        self.capacity = capacity
        self.miss_cost_s = miss_cost_s
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def encode(self, text: str) -> list[int]:
        if self.capacity:
            ids = self._cache.get(text)
            if ids is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return list(ids)
        self.misses += 1
        ids = self.inner.encode(text)
        if self.miss_cost_s:
            # Stands for the merge work of a slow BPE; a busy wait, so the
            # cost is CPU time like the real thing.
            end = time.perf_counter() + self.miss_cost_s
            while time.perf_counter() < end:
                pass
        if self.capacity:
            self._cache[text] = list(ids)
            if len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return list(ids)

    def decode(self, ids: Sequence[int]) -> str | None:
        return self.inner.decode(ids)
