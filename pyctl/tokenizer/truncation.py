"""Class 10: truncation and padding-mask consistency.

Inputs sit at and just over the context limit (0, 1, L-1, L, L+1 and 2L
tokens) and are batched together so padding is needed; each batch is
padded left and right and truncated from the right and the left. The
checker verifies, per row, that ids, attention mask and truncation agree:

  length       len(ids) == len(mask) == the padded length
  mask-values  the mask holds only 0 and 1
  mask-count   ones == min(untruncated length, L)
  pad-side     zeros only on the padding side, ids there == pad id
  content      ids under mask 1 == the untruncated ids cut on the right
               side (head kept for right truncation, tail for left)
  pad-in-content (warning) a pad id under mask 1: literal pad-token text
               in the input; a model that derives the mask from
               ids != pad_id would silently drop it

Targets: `hf` uses the library's own truncation and padding
(enable_truncation / enable_padding on a copy of the tokenizer); objects
with a `.collate(...)` method use theirs; anything else goes through
`reference_collate`, our plain implementation (tiktoken has no padding).

Injection: `corrupt_rows` perturbs ids or mask of collated rows (mask-flip,
mask-shift, id-to-pad, id-random), the in-process form of the `corrupt`
action on the tokenizer's output buffer, so users can feed the perturbed
batch to their model and watch what it does; every corrupted row gets a
fault ID.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyctl.tokenizer.builders import generate_corpus
from pyctl.tokenizer.record import Recorder

Row = tuple[list[int], list[int]]  # (ids, attention mask)
CORRUPT_MODES = ("mask-flip", "mask-shift", "id-to-pad", "id-random")


def reference_collate(
    full: Sequence[Sequence[int]], max_length: int, side: str, pad_id: int, truncate_side: str
) -> list[Row]:
    """Truncate each id list to max_length on `truncate_side`, pad to
    max_length on `side`; the mask marks real tokens."""
    out: list[Row] = []
    for ids in full:
        cut = list(ids[:max_length] if truncate_side == "right" else ids[-max_length:])
        if max_length == 0:
            cut = []
        pad = max_length - len(cut)
        if side == "right":
            out.append((cut + [pad_id] * pad, [1] * len(cut) + [0] * pad))
        else:
            out.append(([pad_id] * pad + cut, [0] * pad + [1] * len(cut)))
    return out


def check_row(
    row: Row, full: Sequence[int], max_length: int, side: str, pad_id: int, truncate_side: str
) -> tuple[list[str], list[str]]:
    """(violations, warnings) for one collated row."""
    ids, mask = list(row[0]), list(row[1])
    bad: list[str] = []
    warn: list[str] = []
    if len(ids) != len(mask) or len(ids) != max_length:
        bad.append(f"length: ids {len(ids)}, mask {len(mask)}, want {max_length}")
    if any(m not in (0, 1) for m in mask):
        bad.append("mask-values")
    want_n = min(len(full), max_length)
    ones = sum(1 for m in mask if m == 1)
    if ones != want_n:
        bad.append(f"mask-count: {ones} ones, want {want_n}")
    n = min(len(ids), len(mask))
    pairs = list(zip(ids[:n], mask[:n], strict=True))
    # Mask must be one block of ones on the content side.
    expect = [1] * want_n + [0] * (max_length - want_n)
    if side == "left":
        expect.reverse()
    if mask != expect and not any(b.startswith("mask-count") for b in bad):
        bad.append("pad-side: mask ones not contiguous on the content side")
    if any(i != pad_id for i, m in pairs if m == 0):
        bad.append("pad-side: non-pad id under mask 0")
    content = [i for i, m in pairs if m == 1]
    cut = list(full[:max_length] if truncate_side == "right" else full[len(full) - want_n :])
    if content != cut:
        bad.append(f"content: ids under mask differ from the {truncate_side}-truncated input")
    if any(i == pad_id for i, m in pairs if m == 1):
        warn.append("pad-in-content")
    return bad, warn


def boundary_texts(target: Any, limit: int, seed: int = 3) -> list[tuple[str, str]]:
    """(label, text) whose token counts are 0, 1, L-1, L, L+1 and 2L (as
    near as whole words allow), plus one with literal pad-token text."""
    words = " ".join(generate_corpus(200, seed=seed)).split(" ")
    out: list[tuple[str, str]] = [("empty", "")]
    for label, want in (
        ("one", 1),
        ("L-1", limit - 1),
        ("L", limit),
        ("L+1", limit + 1),
        ("2L", 2 * limit),
    ):
        text = ""
        for w in words:
            nxt = (text + " " + w) if text else w
            if len(target.encode(nxt)) > want:
                break
            text = nxt
        # Top up with single characters to land on the exact count.
        while len(target.encode(text)) < want:
            text += "a" if len(target.encode(text + "a")) <= want else " a"
            if len(text) > 20 * want + 10:
                break
        out.append((label, text))
    pad_text = next(iter(k for k in getattr(target, "specials", {}) if "PAD" in k.upper()), None)
    if pad_text:
        literal = f"hello {pad_text} world"
        try:
            target.encode(literal)
            out.append(("pad-literal", literal))
        except ValueError:
            pass  # tiktoken refuses special-token text by default: nothing to check
    return out


def collate(
    target: Any,
    texts: Sequence[str],
    max_length: int,
    side: str,
    pad_id: int,
    truncate_side: str,
) -> list[Row]:
    if hasattr(target, "collate"):
        return [
            (list(a), list(b))
            for a, b in target.collate(texts, max_length, side, pad_id, truncate_side)
        ]
    tok = getattr(target, "tok", None)
    if tok is not None and hasattr(tok, "enable_padding"):
        # lazy: tokenizers (+14 modules) only when this runs
        from tokenizers import Tokenizer

        t = Tokenizer.from_str(tok.to_str())  # a copy: leave the user's settings alone
        t.enable_truncation(max_length, direction=truncate_side)
        t.enable_padding(direction=side, pad_id=pad_id, length=max_length)
        encs = t.encode_batch(list(texts), add_special_tokens=False)
        return [(list(e.ids), list(e.attention_mask)) for e in encs]
    return reference_collate(
        [target.encode(t) for t in texts], max_length, side, pad_id, truncate_side
    )


def pad_id_of(target: Any) -> int:
    for k, v in getattr(target, "specials", {}).items():
        if "PAD" in k.upper():
            return int(v)
    return 0


def corrupt_rows(
    rows: list[Row], mode: str, rate: float, rng: random.Random, pad_id: int = 0
) -> list[tuple[int, dict[str, Any]]]:
    """Perturb rows in place; returns (row index, what was done) per change."""
    if mode not in CORRUPT_MODES:
        raise ValueError(f"unknown corruption {mode!r}; choose one of {', '.join(CORRUPT_MODES)}")
    done: list[tuple[int, dict[str, Any]]] = []
    for r, (ids, mask) in enumerate(rows):
        if not ids or rng.random() >= rate:
            continue
        before = (list(ids), list(mask))
        content = [p for p, m in enumerate(mask) if m == 1] or list(range(len(ids)))
        pos = rng.choice(content)
        if mode == "mask-flip":
            pos = rng.randrange(len(mask))
            mask[pos] ^= 1
        elif mode == "mask-shift":
            mask[:] = mask[1:] + mask[:1]
        elif mode == "id-to-pad":
            ids[pos] = pad_id
        elif mode == "id-random":
            ids[pos] = ids[pos] + 1 + rng.randrange(1000)
        if (ids, mask) != before:  # a shift of an all-ones mask changes nothing
            done.append((r, {"mode": mode, "pos": pos}))
    return done


@dataclass
class TruncReport:
    target: str
    max_length: int
    rows: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)
    injected: int = 0
    injected_detected: int = 0


def run_truncation(
    target: Any,
    *,
    max_length: int = 32,
    corrupt: str | None = None,
    rate: float = 0.5,
    seed: int = 1,
    recorder: Recorder | None = None,
    progress: Callable[[int], None] | None = None,
) -> TruncReport:
    if max_length < 2:
        raise ValueError("max_length must be >= 2")
    cases = boundary_texts(target, max_length)
    texts = [t for _, t in cases]
    full = [list(target.encode(t)) for t in texts]
    pad_id = pad_id_of(target)
    rep = TruncReport(getattr(target, "name", "?"), max_length)
    rng = random.Random(seed)
    for side in ("right", "left"):
        for trunc in ("right", "left"):
            rows = collate(target, texts, max_length, side, pad_id, trunc)
            changes = corrupt_rows(rows, corrupt, rate, rng, pad_id) if corrupt else []
            changed = dict(changes)
            for r, ((label, text), row, f) in enumerate(zip(cases, rows, full, strict=True)):
                bad, warn = check_row(row, f, max_length, side, pad_id, trunc)
                rep.rows += 1
                where = {"label": label, "pad_side": side, "truncate_side": trunc, "row": r}
                if r in changed:
                    rep.injected += 1
                    rep.injected_detected += bool(bad)
                for b in bad:
                    rep.violations.append({**where, "violation": b, "injected": r in changed})
                for w in warn:
                    rep.warnings.append({**where, "warning": w})
                if recorder is not None:
                    outcome = "violation" if bad else ("warning" if warn else "ok")
                    recorder.add(
                        f"{label}/pad-{side}/trunc-{trunc}",
                        text,
                        outcome,
                        error="; ".join(bad),
                        details={
                            **where,
                            "warnings": warn,
                            "injected": changed.get(r),
                            "full_len": len(f),
                        },
                    )
            if progress:
                progress(1)
    if recorder is not None:
        recorder.flush()
    return rep
