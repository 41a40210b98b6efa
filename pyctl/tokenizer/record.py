"""Campaign results in the evidence store: table `tok_cases`, one row per
injected case, keyed by fault ID `<run_id>-<seq>`.

Inputs are redacted by default: the row keeps the SHA-256 of the UTF-8
bytes (lone surrogates encoded with surrogatepass) and the lengths; the
text itself only with keep_text=True (`--keep-text`). Exception messages
are redacted too (a tokenizer's error often quotes its input): every form
of the input (as is, repr-escaped, backslash-escaped) and every quoted
literal in the message become <redacted>.

A finding (any outcome but ok, rejected and warning, a case flagged
slow, or a case the campaign corrupted) is also a `faults` row under the
same fault ID (action `input`, or `corrupt` for a case the campaign
corrupted itself; mechanism `in-process`; function the tokenizer entry
point), so `gpufault faults` and `gpufault show` know it
(pyctl/evidence/layers.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from pyctl.evidence import layers, schema

TABLE = "tok_cases"
# Outcomes that are not findings: no faults row for them.
NOT_FINDINGS = frozenset({"ok", "rejected", "warning"})


def text_bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def digest(text: str) -> str:
    return hashlib.sha256(text_bytes(text)).hexdigest()


ERROR_MAX = 500
# A quote opens a literal only after a non-word character (not "can't").
_QUOTED = re.compile(r"""(?<!\w)(['"])(?:\\.|(?!\1).)*\1""")


def redact_error(error: str, text: str) -> str:
    """error without the input in it: the input's own forms first (a long
    enough one anywhere, a short one only where quoted), then every quoted
    literal, since a message may quote a piece of the input."""
    if not error:
        return error
    forms = {
        text,
        repr(text)[1:-1],
        ascii(text)[1:-1],
        text_bytes(text).decode("utf-8", "backslashreplace"),
    }
    for f in sorted(forms, key=len, reverse=True):
        if len(f) >= 4:
            error = error.replace(f, "<redacted>")
    return _QUOTED.sub(lambda m: f"{m.group(1)}<redacted>{m.group(1)}", error)


def cut(error: str, limit: int = ERROR_MAX) -> str:
    """At most limit characters, saying how many were cut."""
    if len(error) <= limit:
        return error
    return error[:limit] + f" ... [{len(error) - limit} more characters cut]"


def ensure_table(db: Any) -> None:
    """tok_cases (with every other table: pyctl/evidence/schema.py)."""
    schema.ensure_schema(db)


@dataclass
class Recorder:
    """Buffers rows and writes them in one transaction per batch. With no
    database it only numbers the cases (for --json without --db)."""

    db: Any | None
    run_id: str
    campaign: str
    keep_text: bool = False
    batch: int = 500
    seq: int = 0
    # The tokenizer entry point the cases went through, and the target.
    function: str = "encode"
    library: str | None = None
    findings: int = 0
    _rows: list[dict[str, Any]] = field(default_factory=list)
    _faults: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.db is not None:
            ensure_table(self.db)

    def add(
        self,
        kind: str,
        text: str,
        outcome: str,
        *,
        error: str = "",
        latency_ns: int | None = None,
        details: dict[str, Any] | None = None,
    ) -> str:
        self.seq += 1
        fid = f"{self.run_id}-{self.seq}"
        stored_error = cut(error if self.keep_text else redact_error(error, text))
        injected = (details or {}).get("injected")
        # A corruption the campaign injected is a fault even when its
        # checker missed it (then the fault says result ok).
        if outcome not in NOT_FINDINGS or (details or {}).get("slow") or injected:
            self.findings += 1
            self._faults.append(
                layers.fault_row(
                    self.run_id,
                    self.seq,
                    action="corrupt" if injected else "input",
                    function=self.function,
                    library=self.library,
                    mechanism="in-process",
                    latency_ns=latency_ns,
                    outcome={
                        "campaign": self.campaign,
                        "case": "/".join(str(x) for x in (kind, (details or {}).get("case")) if x),
                        "result": outcome,
                        **({"error": stored_error} if stored_error else {}),
                        **({"injected": injected} if injected else {}),
                        **({"slow": True} if (details or {}).get("slow") else {}),
                    },
                )
            )
        self._rows.append(
            {
                "fault_id": fid,
                "run_id": self.run_id,
                "seq": self.seq,
                "campaign": self.campaign,
                "kind": kind,
                "input_sha256": digest(text),
                "input_len": len(text),
                "input_bytes": len(text_bytes(text)),
                # Text is stored as UTF-8 with surrogates escaped, so every
                # input fits SQLite's TEXT type.
                "text": text_bytes(text).decode("utf-8", "backslashreplace")
                if self.keep_text
                else None,
                "outcome": outcome,
                "error": stored_error,
                "latency_ns": latency_ns,
                "details": json.dumps(details or {}, sort_keys=True, default=str),
            }
        )
        if len(self._rows) >= self.batch:
            self.flush()
        return fid

    def flush(self) -> None:
        if self.db is not None and self._rows:
            with self.db.conn:
                self.db[TABLE].insert_all(self._rows)
                # The findings' faults rows, in the same transaction.
                layers.insert_faults(self.db, self._faults)
        self._rows.clear()
        self._faults.clear()
