"""Build real tokenizers in-process from generated data (no downloads).

`build_hf_bpe` trains a byte-level BPE with Hugging Face `tokenizers` on a
corpus we generate; `build_tiktoken` builds a `tiktoken.Encoding` from
mergeable ranks, by default the ranks of that same trained BPE converted
to bytes, so both libraries tokenize the same language.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterable, Sequence
from typing import Any

# GPT-2's split pattern (tiktoken's r50k_base uses the same one).
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
HF_SPECIALS = ("[PAD]", "[BOS]", "[EOS]", "[UNK]")
TIKTOKEN_SPECIALS = ("<|endoftext|>", "<|pad|>")

_SYLLABLES = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"] + ["qu", "th", "ch", "sh"]
_EXTRA = ["über", "naïve", "café", "Привет", "мир", "日本語", "テキスト", "مرحبا", "שלום", "🙂"]


def make_word(rng: random.Random, lo: int = 1, hi: int = 4) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(lo, hi)))


def generate_corpus(n_lines: int = 2000, seed: int = 1, words_per_line: int = 12) -> list[str]:
    """Deterministic pseudo-language text with a little punctuation,
    digits and non-Latin words, so the trained vocabulary has some depth."""
    rng = random.Random(seed)
    vocab = [make_word(rng) for _ in range(600)] + _EXTRA
    # Zipf-ish word frequencies make real merges (frequent words become tokens).
    weights = [1.0 / (i + 1) for i in range(len(vocab))]
    lines = []
    for _ in range(n_lines):
        words = rng.choices(vocab, weights, k=words_per_line)
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        line = " ".join(words)
        lines.append(line.capitalize() + rng.choice([".", "!", "?", ",", ""]))
    return lines


def build_hf_bpe(
    vocab_size: int = 1000,
    corpus: Iterable[str] | None = None,
    *,
    cache_capacity: int | None = None,
    specials: Sequence[str] = HF_SPECIALS,
) -> Any:
    """Train a byte-level BPE `tokenizers.Tokenizer` (round-trips any str
    without lone surrogates). `cache_capacity` sets the BPE word cache
    (0 disables it; None keeps the library default, 10000 in 0.23)."""
    # lazy: tokenizers (+15 modules) only when this runs
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    lines = list(corpus) if corpus is not None else generate_corpus()
    if not lines:
        raise ValueError("empty corpus: give at least one line of text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    if cache_capacity is not None:
        # Rebuild the model from the trained vocab and merges: the cache
        # capacity is a constructor argument only.
        vocab, merges = _vocab_and_merges(tok)
        tok.model = models.BPE(vocab=vocab, merges=merges, cache_capacity=cache_capacity)
    return tok


def reference_bpe(vocab_size: int = 1000, seed: int = 1) -> Any:
    """The reference service's tokenizer (pyctl/service/tokenizer.py), and
    any client that must count its tokens exactly (the experiments' corpora):
    one recipe, trained deterministically in about 0.1 s."""
    return build_hf_bpe(vocab_size, generate_corpus(n_lines=2000, seed=seed))


def _vocab_and_merges(tok: Any) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    return dict(model["vocab"]), merges  # type: ignore[return-value]


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def generate_ranks(n_merges: int = 700, corpus: Iterable[str] | None = None) -> dict[bytes, int]:
    """tiktoken mergeable ranks: the 256 single bytes, then the merges of a
    byte-level BPE trained on `corpus`, in merge order."""
    tok = build_hf_bpe(256 + len(HF_SPECIALS) + n_merges, corpus)
    _vocab, merges = _vocab_and_merges(tok)
    dec = _byte_decoder()
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for a, b in merges:
        token = bytes(dec[ch] for ch in a + b)
        ranks.setdefault(token, len(ranks))
    return ranks


def build_tiktoken(
    ranks: dict[bytes, int] | None = None,
    *,
    pat_str: str = GPT2_PAT,
    specials: Sequence[str] = TIKTOKEN_SPECIALS,
    name: str = "gpufault-test",
) -> Any:
    """A `tiktoken.Encoding` from ranks (generated when None)."""
    # lazy: tiktoken (concurrent, logging, +23 modules) only when this runs
    import tiktoken

    r = ranks if ranks is not None else generate_ranks()
    if sorted(r.values()) != list(range(len(r))):
        raise ValueError("ranks must be 0..N-1 without gaps (tiktoken requires it)")
    special = {s: len(r) + i for i, s in enumerate(specials)}
    return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=r, special_tokens=special)
