"""Class 9: Unicode boundary and BPE depth.

`generate_cases` yields adversarial inputs by category; `run_fuzz` sends
each through a target and classifies the outcome:

  ok              encoded (and round-tripped where that should hold)
  rejected        a clean ValueError/TypeError/UnicodeError: the library
                  refused the input (not a finding; a service must map it
                  to a 4xx, which the HTTP mode shows)
  exception       any other exception
  panic           a Rust panic surfaced as pyo3's PanicException
  target-error    HTTP 5xx, a dropped connection (a crashed worker) or a
                  reply that is not {"ids": [...]}
  roundtrip-fail  decode(encode(x)) != x although x is valid Unicode
                  without special-token text (byte-level BPEs must
                  round-trip it)
  slow            (flag) cost per character far above the target's own
                  median for long inputs (and over 2 ms, and still so at
                  the best of three runs): superlinear (BPE depth) work

Byte-level cases (invalid and overlong UTF-8) reach Python tokenizers as
str with surrogateescape (U+DC80..U+DCFF), which is what a server gets
from `bytes.decode('utf-8', 'surrogateescape')`; `Case.raw` keeps the bytes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyctl.tokenizer.record import Recorder
from pyctl.tokenizer.targets import TargetError

CATEGORIES = (
    "lone_surrogate",
    "reversed_surrogate",
    "invalid_utf8",
    "overlong_utf8",
    "noncharacter",
    "combining_storm",
    "zero_width_run",
    "long_repeat",
    "nested_special",
    "malformed_special",
    "mixed_script",
    "control",
)
FINDINGS = ("exception", "panic", "target-error", "roundtrip-fail", "slow")


@dataclass(frozen=True)
class Case:
    category: str
    name: str
    text: str
    raw: bytes | None = None  # the bytes for byte-level categories

    @property
    def roundtrip_expected(self) -> bool:
        """Should decode(encode(text)) == text hold for a byte-level BPE?"""
        try:
            self.text.encode("utf-8")
        except UnicodeEncodeError:
            return False  # lone surrogates have no UTF-8 form
        return self.category not in ("nested_special", "malformed_special")


def _b(raw: bytes, category: str, name: str) -> Case:
    return Case(category, name, raw.decode("utf-8", "surrogateescape"), raw)


def generate_cases(
    specials: Sequence[str] = ("<|endoftext|>", "[PAD]"),
    *,
    max_len: int = 100_000,
    categories: Sequence[str] | None = None,
) -> Iterator[Case]:
    """All adversarial cases, deterministic. `max_len` caps the long ones
    (10^5 by default: repeated pieces deep enough to stress BPE merges)."""
    want = set(categories or CATEGORIES)
    unknown = want - set(CATEGORIES)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}; known: {', '.join(CATEGORIES)}")
    n = max_len
    out: list[Case] = []
    add = out.append
    if "lone_surrogate" in want:
        add(Case("lone_surrogate", "high", "\ud800"))
        add(Case("lone_surrogate", "low", "\udfff"))
        add(Case("lone_surrogate", "high-in-word", "abc\ud83ddef"))
        add(Case("lone_surrogate", "trailing-high", "emoji \ud83d"))
    if "reversed_surrogate" in want:
        add(Case("reversed_surrogate", "low-high", "\ude00\ud83d"))
        add(Case("reversed_surrogate", "in-text", "x \udc00\ud800 y"))
    if "invalid_utf8" in want:
        add(_b(b"\xff\xfe", "invalid_utf8", "ff-fe"))
        add(_b(b"abc\x80def", "invalid_utf8", "lone-continuation"))
        add(_b(b"\xe2\x82", "invalid_utf8", "truncated-3byte"))
        add(_b(b"\xed\xa0\x80", "invalid_utf8", "encoded-surrogate"))
        add(_b(b"\xf4\x90\x80\x80", "invalid_utf8", "above-10ffff"))
    if "overlong_utf8" in want:
        add(_b(b"\xc0\xaf", "overlong_utf8", "slash-2byte"))
        add(_b(b"\xe0\x80\xaf", "overlong_utf8", "slash-3byte"))
        add(_b(b"\xf0\x80\x80\xaf", "overlong_utf8", "slash-4byte"))
        add(_b(b"a\xc0\x80b", "overlong_utf8", "nul-2byte"))
    if "noncharacter" in want:
        add(Case("noncharacter", "fffe-ffff", "\ufffe\uffff"))
        add(Case("noncharacter", "fdd0-run", "".join(chr(c) for c in range(0xFDD0, 0xFDF0))))
        add(Case("noncharacter", "plane-ends", "x\U0001fffe\U0010ffffy"))
    if "combining_storm" in want:
        add(Case("combining_storm", "acute-x1000", "a" + "\u0301" * 1000))
        add(
            Case(
                "combining_storm", "zalgo", "".join("z\u0336\u0337\u0338\u034f" for _ in range(200))
            )
        )
        add(Case("combining_storm", "marks-only", "\u0300\u0301\u0302" * (n // 3)))
    if "zero_width_run" in want:
        add(Case("zero_width_run", "zwsp", "\u200b" * n))
        add(Case("zero_width_run", "zwj-between", "\u200d".join("word") * 10))
        add(Case("zero_width_run", "bom-wj-mix", "a\ufeff\u2060\u200c\u200bb"))
    if "long_repeat" in want:
        add(Case("long_repeat", "one-char", "a" * n))
        add(Case("long_repeat", "two-char", "ab" * (n // 2)))
        add(Case("long_repeat", "syllables", "bapu" * (n // 4)))
        add(Case("long_repeat", "spaces", " " * n))
        add(Case("long_repeat", "digits", "1" * n))
        add(Case("long_repeat", "emoji", "\U0001f642" * n))
    if "nested_special" in want:
        for s in specials:
            add(Case("nested_special", f"bare {s}", s))
            add(Case("nested_special", f"in-text {s}", f"hello {s} world"))
            mid = len(s) // 2
            add(Case("nested_special", f"nested {s}", s[:mid] + s + s[mid:]))
            add(Case("nested_special", f"repeated {s}", s * 100))
    if "malformed_special" in want:
        for s in specials:
            add(Case("malformed_special", f"unclosed {s}", s[:-1]))
            add(Case("malformed_special", f"unopened {s}", s[1:]))
            add(Case("malformed_special", f"zw-inside {s}", s[:2] + "\u200b" + s[2:]))
            add(Case("malformed_special", f"case {s}", s.upper() if s != s.upper() else s.lower()))
    if "mixed_script" in want:
        add(Case("mixed_script", "homoglyph", "p\u0430yp\u0430l.com"))
        add(Case("mixed_script", "rtl-override", "abc\u202edcba\u202cxyz"))
        add(
            Case(
                "mixed_script", "many-scripts", "Hello Привет こんにちは 안녕 مرحبا שלום नमस्ते 你好"
            )
        )
        add(Case("mixed_script", "emoji-zwj", "\U0001f469\u200d\U0001f4bb\U0001f44d\U0001f3fd"))
        add(Case("mixed_script", "flags", "\U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5"))
    if "control" in want:
        add(Case("control", "nul-esc", "a\x00b\x1b[31mc"))
        add(Case("control", "crlf-mix", "a\r\nb\rc\nd\u2028e\u2029f\x85g"))
    yield from out


@dataclass
class CaseOutcome:
    case: Case
    outcome: str
    error: str = ""
    latency_ns: int = 0
    n_ids: int = 0
    slow: bool = False
    fault_id: str = ""


@dataclass
class FuzzReport:
    target: str
    outcomes: list[CaseOutcome] = field(default_factory=list)
    median_ns_per_char: float = 0.0

    @property
    def findings(self) -> list[CaseOutcome]:
        return [o for o in self.outcomes if o.outcome in FINDINGS or o.slow]

    def by_category(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = {}
        for o in self.outcomes:
            row = table.setdefault(o.case.category, {})
            row[o.outcome] = row.get(o.outcome, 0) + 1
            if o.slow:
                row["slow"] = row.get("slow", 0) + 1
        return table


def classify_exception(e: BaseException) -> str:
    if isinstance(e, TargetError):
        return "target-error"
    if type(e).__name__ == "PanicException":
        return "panic"
    if isinstance(e, (ValueError, TypeError, UnicodeError)):
        return "rejected"
    return "exception"


def run_fuzz(
    target: Any,
    cases: Sequence[Case],
    *,
    recorder: Recorder | None = None,
    slow_factor: float = 20.0,
    long_len: int = 1000,
    slow_floor_ns: int = 2_000_000,
    progress: Callable[[int], None] | None = None,
) -> FuzzReport:
    """Run every case once through `target` (see the module doc)."""
    rep = FuzzReport(getattr(target, "name", "?"))
    for case in cases:
        t0 = time.perf_counter_ns()
        try:
            ids = target.encode(case.text)
            dt = time.perf_counter_ns() - t0
            out = CaseOutcome(case, "ok", latency_ns=dt, n_ids=len(ids))
            if case.roundtrip_expected:
                dec = target.decode(ids)
                if dec is not None and dec != case.text:
                    out.outcome = "roundtrip-fail"
                    out.error = f"decoded {len(dec)} chars, want {len(case.text)}"
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: B036 - pyo3 panics derive from BaseException
            dt = time.perf_counter_ns() - t0
            out = CaseOutcome(case, classify_exception(e), f"{type(e).__name__}: {e}", dt)
        rep.outcomes.append(out)
        if progress:
            progress(1)
    # Latency outliers: cost per character against the median of long inputs
    # (short inputs are dominated by per-call overhead).
    long_ok = [o for o in rep.outcomes if len(o.case.text) >= long_len and o.outcome != "rejected"]
    if len(long_ok) >= 3:
        per_char = [o.latency_ns / len(o.case.text) for o in long_ok]
        rep.median_ns_per_char = statistics.median(per_char)
        limit = slow_factor * rep.median_ns_per_char
        for o, pc in zip(long_ok, per_char, strict=True):
            if pc <= limit or o.latency_ns < slow_floor_ns:
                continue
            # A suspect: time it twice more and keep the fastest, so one
            # scheduling hiccup on a shared machine is not a finding.
            best = o.latency_ns
            for _ in range(2):
                t0 = time.perf_counter_ns()
                try:
                    target.encode(o.case.text)
                except Exception:
                    break
                best = min(best, time.perf_counter_ns() - t0)
            o.slow = best / len(o.case.text) > limit
    if recorder is not None:
        for o in rep.outcomes:
            o.fault_id = recorder.add(
                o.case.category,
                o.case.text,
                o.outcome,
                error=o.error,
                latency_ns=o.latency_ns,
                details={"case": o.case.name, "n_ids": o.n_ids, "slow": o.slow},
            )
        recorder.flush()
    return rep
