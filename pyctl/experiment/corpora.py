"""Request bodies for [load] and traffic steps: the prompt mix an experiment sends.

The generators are the tokenizer campaigns' own (pyctl/tokenizer/):
class 9's adversarial cases (`unicode`: lone and reversed surrogates,
invalid and overlong UTF-8 as raw bytes inside the JSON string, combining
storms, long repeats, nested specials), class 10's boundary (`over-limit`:
prompts 1, 2, 8, 64 and 10 x the context tokens past what the context
leaves room for; `at-limit`: exactly the room, the longest prompt the
service must accept, so batches get maximal left padding), class 12's
mix (`hot`: Zipf-distributed words of a fixed pool; `cold`: words never
seen before, a new one in every request).

Token counts are those of the reference service's tokenizer, rebuilt here
from the same recipe and vocabulary size (pyctl.tokenizer.builders.
reference_bpe, which the service trains too, in about 0.1 s), so "one
token over the limit" is exact; the service itself is not imported.
"""

from __future__ import annotations

import json
from typing import Any

from pyctl.experiment.model import Load

# Past the room the context leaves (context - max_tokens), in tokens.
OVER_BY = (1, 2, 8, 64)


_MARK = "\x00gf-prompt\x00"  # where a raw prompt goes in a template's JSON


def _fill(v: Any, prompt: str, max_tokens: int, messages: list[dict[str, str]]) -> Any:
    """A body template with "$prompt" / "$max_tokens" filled in ("$max_tokens"
    alone is the number; inside a longer string, its digits); a string that
    is exactly "$messages" becomes the chat list."""
    if isinstance(v, str):
        if v == "$max_tokens":
            return max_tokens
        if v == "$messages":
            return messages
        return v.replace("$max_tokens", str(max_tokens)).replace("$prompt", prompt)
    if isinstance(v, dict):
        return {k: _fill(x, prompt, max_tokens, messages) for k, x in v.items()}
    if isinstance(v, list):
        return [_fill(x, prompt, max_tokens, messages) for x in v]
    return v


def request_body(
    load: Load,
    prompt: str,
    max_tokens: int | None = None,
    messages: list[dict[str, str]] | None = None,
) -> bytes:
    """One request's body: the file's template filled, else the completion
    request (with "stream": true for a streaming load). messages: the
    chat list "$messages" stands for (default: the prompt as one user
    message)."""
    mt = load.max_tokens if max_tokens is None else max_tokens
    if load.body is not None:
        chat = messages if messages is not None else [{"role": "user", "content": prompt}]
        obj = _fill(load.body, prompt, mt, chat)
    else:
        obj = {"prompt": prompt, "max_tokens": mt, "temperature": 0}
        if load.stream:
            obj["stream"] = True
    # ensure_ascii: a lone surrogate goes out as the JSON escape \\ud800 (what
    # a client in any language can send), not as bytes no encoder writes.
    return json.dumps(obj).encode()


def _raw_body(load: Load, raw: bytes, max_tokens: int) -> bytes:
    """Invalid UTF-8 bytes inside the JSON string, as a broken client sends them."""
    mark = json.dumps(_MARK)[1:-1].encode()
    return request_body(load, _MARK, max_tokens).replace(mark, raw)


class _Counter:
    """Counts tokens as the reference service does: its tokenizer's recipe
    (pyctl.tokenizer.builders.reference_bpe), an empty prompt one token."""

    def __init__(self, vocab_size: int) -> None:
        # lazy: keeps pyctl.tokenizer.builders (+2 modules) off `--help`
        from pyctl.tokenizer.builders import reference_bpe

        self.tok = reference_bpe(vocab_size)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tok.encode(text).ids
        return ids or [0]


def _tokenizer(vocab_size: int) -> Any:
    return _Counter(vocab_size)


def _text_of(tok: Any, n_tokens: int, *, at_most: bool, seed: int = 3) -> str:
    """A prompt of the pseudo-language with exactly n_tokens tokens (or, if
    no prefix has exactly that many, the nearest above; at_most: below)."""
    # lazy: keeps pyctl.tokenizer.builders (+2 modules) off `--help`
    from pyctl.tokenizer.builders import generate_corpus

    text = ""
    lines = iter(generate_corpus(n_lines=4000, seed=seed))
    while len(tok.encode(text)) < n_tokens + 2:
        text += next(lines) + " "
    lo, hi = 0, len(text)  # smallest prefix with >= n_tokens tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tok.encode(text[:mid])) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    for cut in range(lo, min(lo + 8, len(text)) + 1):
        if len(tok.encode(text[:cut])) == n_tokens:
            return text[:cut]
    if at_most:
        cut = lo
        while cut > 0 and len(tok.encode(text[:cut])) > n_tokens:
            cut -= 1
        return text[:cut]
    return text[:lo]


def bodies(load: Load, n_requests: int) -> list[bytes] | None:
    """The bodies request i sends in turn (i % len); None: the one prompt."""
    got = cases(load, n_requests)
    return None if got is None else [b for _name, b in got]


def cases(load: Load, n_requests: int) -> list[tuple[str, bytes]] | None:
    """(name, body) of each body in turn: the name says which case a bad
    answer belongs to (lone_surrogate/high, over-limit/+1)."""
    c, mt = load.corpus, load.max_tokens

    def _body(prompt: str, max_tokens: int) -> bytes:
        return request_body(load, prompt, max_tokens)

    if c == "prompt":
        if load.body is None and not load.stream:
            return None  # the load generator's own {"prompt", "max_tokens"}
        return [("prompt", _body(load.prompt, mt))]
    if c == "prompts" and load.prompt_set is not None:
        return [
            (
                f"line {i + 1}",  # of the entries (blank lines skipped)
                request_body(load, e.text, e.max_tokens or mt, e.chat()),
            )
            for i, e in enumerate(load.prompt_set.entries)
        ]
    if c == "prompts":
        return [(f"prompt {i}", _body(p, mt)) for i, p in enumerate(load.prompts)]
    if c == "unicode":
        # lazy: keeps pyctl.tokenizer.unicode (+20 modules, ~100 ms) off `--help`
        from pyctl.tokenizer.unicode import generate_cases

        return [
            (
                f"{case.category}/{case.name}",
                _raw_body(load, case.raw, mt) if case.raw is not None else _body(case.text, mt),
            )
            for case in generate_cases(("[PAD]", "[BOS]", "[EOS]"), max_len=load.max_len)
        ]
    if c in ("over-limit", "at-limit"):
        tok = _tokenizer(load.vocab_size)
        room = load.context - mt
        if c == "at-limit":
            return [(f"at-limit/{room}", _body(_text_of(tok, room, at_most=True), mt))]
        over = [*OVER_BY, 10 * load.context - room]
        return [
            (f"over-limit/+{k}", _body(_text_of(tok, room + k, at_most=False), mt)) for k in over
        ]
    if c == "hot":
        # lazy: keeps pyctl.tokenizer.cache (hashlib, sqlite3, +13 modules) off `--help`
        from pyctl.tokenizer.cache import hot_pool

        return [(f"hot/{i}", _body(t, mt)) for i, t in enumerate(hot_pool(n_texts=200))]
    if c == "cold":
        # lazy: keeps pyctl.tokenizer.cache (hashlib, sqlite3, +13 modules) off `--help`
        from pyctl.tokenizer.cache import ColdWords

        cold = ColdWords()
        # One never-seen text per request: none repeats within the run.
        return [(f"cold/{i}", _body(cold.text(8), mt)) for i in range(max(1, n_requests))]
    raise ValueError(f"unknown corpus {c!r}")


def describe(load: Load) -> str:
    """One line for the run's output and the evidence."""
    if load.corpus == "prompt":
        return f"prompt {load.prompt!r}"
    if load.corpus == "prompts" and load.prompt_set is not None:
        return f"{len(load.prompt_set.entries)} prompts of {load.prompt_set.path} in turn"
    if load.corpus == "prompts":
        return f"{len(load.prompts)} prompts in turn"
    return f"corpus {load.corpus}"


__all__ = ["bodies", "cases", "describe", "request_body", "OVER_BY"]
