"""The quality probe ([quality]): the half of an SLO that latency cannot see.

A fixed set of prompts with reference outputs is sent in rounds, one
round at most every `interval`, from the end of the warm-up until the run
ends; each answer's text is scored against its reference with BLEU-4
(sacrebleu's corpus BLEU, its default 13a tokenizer) or exact match. A
phase's score is that of every answer of its rounds together; the bound
is on the drop from the baseline's score, in percent:

    drop_pct = max(0, (baseline - phase) / baseline * 100)

so "BLEU-4 drop <= 5 %" reads `bleu_drop_pct = "<= 5"`. A case without a
`reference` is scored against the first baseline answer to it (the
service agreeing with itself). An answer that failed (not 2xx, a timeout)
scores as an empty text: an error has no quality. Requests go where the
[load] sends (its URL, method, headers, body template; streamed answers
are read from their events) with the probe's max_tokens, else to the
target's POST /v1/completions.

    [quality]
    metric = "bleu"
    bleu_drop_pct = "<= 5"
    cases = [{ prompt = "ka tu ro mi sa", reference = " sa sa sa sa" }]
    # or: cases = "refs.jsonl", one {"prompt", "reference"} object a line

A case may be a chat instead of a prompt (`messages = [{ role = "user",
content = "..." }]`, or a JSONL line {"messages": [...], "reference":
...}): it is sent as the "$messages" of the [load]'s chat body, so a file
that loads /v1/chat/completions probes its quality through the same API.
"""

from __future__ import annotations

import http.client
import importlib.util
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pyctl.experiment.model import Load, Quality
from pyctl.experiment.promptset import parse_messages
from pyctl.experiment.reader import Reader, mentions, parse_bound, read_set

METRICS = ("bleu", "exact")
KEYS = {
    "metric",
    "bleu_drop_pct",
    "exact_drop_pct",
    "cases",
    "interval",
    "max_tokens",
    "timeout",
    "tokenize",
}
TOKENIZERS = ("13a", "none", "intl", "char", "zh")


def parse_quality(r: Reader, doc: dict[str, Any], load: Load | None = None) -> Quality | None:
    if "quality" not in doc:
        return None
    t = r.table(doc, "quality", KEYS)
    metric = r.str_(t, "quality", "metric", "bleu")
    if metric not in METRICS:
        raise r.err("quality.metric", f"{metric!r}: use one of {', '.join(METRICS)}")
    want, other = f"{metric}_drop_pct", ("exact" if metric == "bleu" else "bleu") + "_drop_pct"
    if other in t:
        raise r.err(f"quality.{other}", f"metric is {metric!r}: bound {want} instead")
    if want not in t:
        raise r.err(f"quality.{want}", 'missing: give the largest drop allowed, e.g. "<= 5"')
    bound = parse_bound(t[want], r, f"quality.{want}", "number")
    if metric == "bleu" and importlib.util.find_spec("sacrebleu") is None:
        raise r.err(
            "quality.metric",
            "BLEU needs sacrebleu: pip install sacrebleu (or gpufault[quality]), "
            'or metric = "exact"',
        )
    tok = r.str_(t, "quality", "tokenize", "13a")
    if tok not in TOKENIZERS:
        raise r.err("quality.tokenize", f"{tok!r}: use one of {', '.join(TOKENIZERS)}")
    raw = t.get("cases")
    if isinstance(raw, str):
        raw = _case_file(r, raw)
    if not isinstance(raw, list) or not raw or not all(isinstance(c, dict) for c in raw):
        raise r.err(
            "quality.cases",
            'expected a list of { prompt = "...", reference = "..." } tables (reference optional)',
        )
    cases: list[tuple[str, str | None]] = []
    chats: list[list[dict[str, str]] | None] = []
    for i, c in enumerate(raw):
        k = f"quality.cases[{i + 1}]"
        r.keys(c, k, {"prompt", "messages", "reference"})
        if ("prompt" in c) == ("messages" in c):
            raise r.err(k, 'give prompt = "..." or messages = [{ role, content }], one of them')
        chat = None
        if "messages" in c:
            try:
                msgs = parse_messages(c["messages"], f"{k}.messages")
            except ValueError as e:
                raise r.err(k, str(e).removeprefix(f"{k}: ")) from None
            chat = [{"role": ro, "content": co} for ro, co in msgs]
            users = [co for ro, co in msgs if ro == "user"]
            prompt = users[-1] if users else ""
        else:
            prompt = r.str_(c, k, "prompt")
        ref = c.get("reference")
        if ref is not None and not isinstance(ref, str):
            raise r.err(f"{k}.reference", "expected a string (the output the answer should be)")
        cases.append((prompt, ref))
        chats.append(chat)
    if any(ch is not None for ch in chats) and not (
        load is not None and load.body is not None and mentions(load.body, "$messages")
    ):
        n = 1 + next(i for i, ch in enumerate(chats) if ch is not None)
        raise r.err(
            f"quality.cases[{n}]",
            'a chat case is sent as the [load]\'s "$messages": give [load] a chat body, '
            'body = { messages = "$messages", max_tokens = "$max_tokens" }, and a chat url',
        )
    interval = r.duration(t, "quality", "interval", "500ms")
    return Quality(
        metric=metric,
        bound=bound,
        cases=cases,
        chats=chats if any(ch is not None for ch in chats) else [],
        interval=interval,
        max_tokens=r.int_(t, "quality", "max_tokens", 16, lo=1),
        timeout=r.duration(t, "quality", "timeout", "3s"),
        tokenize=tok,
    )


def _case_file(r: Reader, name: str) -> list[dict[str, Any]]:
    """cases = "refs.jsonl": the prompt-set format of [load] prompts
    (pyctl/experiment/promptset.py: the same safe open, one-line errors
    with the line), each line a prompt with its optional reference."""
    ps = read_set(r, name, "quality.cases")
    out: list[dict[str, Any]] = []
    for i, e in enumerate(ps.entries, 1):
        if e.max_tokens is not None:
            raise r.err(
                "quality.cases",
                f"{ps.path}: entry {i} has its own max_tokens: a quality case is a prompt (or a "
                "chat) and a reference (the probe's max_tokens is [quality]'s)",
            )
        what: dict[str, Any] = (
            {"prompt": e.prompt} if e.messages is None else {"messages": e.chat()}
        )
        out.append({**what, **({"reference": e.reference} if e.reference else {})})
    return out


# ---- scoring ------------------------------------------------------------------------------


def score(metric: str, hyps: list[str], refs: list[str], tokenize: str = "13a") -> float:
    """0..100: corpus BLEU-4 (sacrebleu), or the share of exact matches
    (surrounding white space ignored) in percent. NaN with no answers."""
    if not hyps:
        return math.nan
    if metric == "exact":
        return (
            100.0 * sum(h.strip() == x.strip() for h, x in zip(hyps, refs, strict=True)) / len(hyps)
        )
    # lazy: sacrebleu (regex, numpy, +30 modules) only for a BLEU probe
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hyps, [refs], tokenize=tokenize).score)


def drop_pct(base: float, now: float) -> float:
    if math.isnan(base) or math.isnan(now) or base <= 0:
        return math.nan
    return max(0.0, (base - now) / base * 100.0)


# ---- the probe ------------------------------------------------------------------------------


@dataclass
class Round:
    start: float  # time.time() when its first request went out
    end: float
    texts: list[str]  # one per case, "" for a failed answer
    errors: int = 0


@dataclass
class QualityProbe:
    """Sends the case set in rounds until stop; rounds() for the scores."""

    q: Quality
    url: str  # the full endpoint
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    bodies: list[bytes] = field(default_factory=list)
    _rounds: list[Round] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    @classmethod
    def build(
        cls, q: Quality, target_url: str, load: Load | None, headers: dict[str, str]
    ) -> QualityProbe:
        # lazy: corpora (the tokenizer corpora's generators) only for a probe that runs
        from pyctl.experiment import corpora

        base = load or Load(1.0, "", q.max_tokens, q.timeout, "/v1/completions", 1)
        return cls(
            q,
            base.endpoint(target_url),
            base.method,
            headers,
            [
                corpora.request_body(base, p, q.max_tokens, chat)
                for (p, _ref), chat in zip(q.cases, q.chats or [None] * len(q.cases), strict=True)
            ],
        )

    def start(self, done: threading.Event) -> threading.Thread:
        self._thread = threading.Thread(
            target=self._loop, args=(done,), name="gf-quality", daemon=True
        )
        self._thread.start()
        return self._thread

    def _loop(self, done: threading.Event) -> None:
        while not done.is_set():
            t = time.time()
            rnd = self.one_round()
            with self._lock:
                self._rounds.append(rnd)
            done.wait(max(0.0, t + self.q.interval - time.time()))

    def one_round(self) -> Round:
        u = urlsplit(self.url)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        https = u.scheme == "https"
        conn_cls = http.client.HTTPSConnection if https else http.client.HTTPConnection
        start = time.time()
        texts, errors = [], 0
        conn = None
        for body in self.bodies:
            try:
                if conn is None:
                    conn = conn_cls(u.hostname or "", u.port, timeout=self.q.timeout)
                hdrs = {"Content-Type": "application/json", **self.headers}
                conn.request(self.method, path, body=body, headers=hdrs)
                resp = conn.getresponse()
                raw = resp.read()
                if not 200 <= resp.status < 300:
                    errors += 1
                    texts.append("")
                    continue
                texts.append(answer_text(resp.getheader("Content-Type") or "", raw))
            except (OSError, http.client.HTTPException):
                errors += 1
                texts.append("")
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()
        return Round(start, time.time(), texts, errors)

    def rounds(self, since: float = 0.0, until: float = math.inf) -> list[Round]:
        with self._lock:
            return [x for x in self._rounds if since <= x.start < until]


def answer_text(content_type: str, raw: bytes) -> str:
    """The generated text of an answer: a JSON one (OpenAI completion or
    chat, TGI), or a stream of events."""
    # lazy: loadgen (queue, sockets) holds the one parser of answers
    from pyctl.experiment.loadgen import answer_text as parse

    return parse(content_type, raw)


@dataclass(frozen=True)
class Scored:
    score: float
    rounds: int
    answers: int
    errors: int


def score_rounds(q: Quality, rounds: list[Round], refs: list[str]) -> Scored:
    hyps = [t for x in rounds for t in x.texts]
    all_refs = [r for _x in rounds for r in refs]
    return Scored(
        score(q.metric, hyps, all_refs, q.tokenize),
        len(rounds),
        len(hyps),
        sum(x.errors for x in rounds),
    )


def references(q: Quality, baseline: list[Round]) -> list[str] | None:
    """Each case's reference: its own, or the first baseline answer to it
    (None when a case has none and the baseline has no round)."""
    first = baseline[0].texts if baseline else None
    out = []
    for i, (_p, ref) in enumerate(q.cases):
        if ref is None:
            if first is None:
                return None
            ref = first[i]
        out.append(ref)
    return out


__all__ = [
    "KEYS",
    "METRICS",
    "QualityProbe",
    "Round",
    "Scored",
    "answer_text",
    "drop_pct",
    "parse_quality",
    "references",
    "score",
    "score_rounds",
]
