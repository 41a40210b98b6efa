"""The node agent's wire format: one JSON object a line (UTF-8, at most
MAX_LINE bytes), each with the protocol version and a kind first.

    {"v": 1, "kind": "arm", "id": 7, ...}      a request; `id` is the client's
    {"v": 1, "kind": "ok", "id": 7, ...}       its answer
    {"v": 1, "kind": "error", "id": 7, "message": "one line"}
    {"v": 1, "kind": "fire", "session": "S", ...}   an event, no id

Requests: hello (first, with the token where one is needed), arm, renew,
disarm, status, sessions, pull (the node's evidence store). Events: fire,
counters, ended; data (a pull's bytes, before its answer). Every request
gets exactly one answer (ok or error); a line that is not a message of
this version is answered with one error line and the connection closed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

VERSION = 1
MAX_LINE = 1 << 20  # a spec list is a few KiB; a megabyte is a client gone wrong

REQUESTS = frozenset({"hello", "arm", "renew", "disarm", "status", "sessions", "pull"})
ANSWERS = frozenset({"ok", "error"})
EVENTS = frozenset({"fire", "counters", "ended", "data"})
# A pull's chunk before base64: well under MAX_LINE once encoded (4/3).
DATA_CHUNK = 384 << 10
KINDS = REQUESTS | ANSWERS | EVENTS


class ProtocolError(ValueError):
    """A line that is not a message of this protocol; str() is one line."""


@dataclass(frozen=True)
class Message:
    kind: str
    body: dict[str, Any] = field(default_factory=dict)
    id: int | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return self.body.get(key, default)


def encode(kind: str, id: int | None = None, **body: Any) -> bytes:
    if kind not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}")
    msg: dict[str, Any] = {"v": VERSION, "kind": kind}
    if id is not None:
        msg["id"] = id
    msg.update(body)
    # ensure_ascii: no raw newline or odd byte can appear inside a line
    data = json.dumps(msg, separators=(",", ":"), ensure_ascii=True).encode() + b"\n"
    if len(data) > MAX_LINE:
        raise ValueError(f"message of {len(data)} bytes is over the {MAX_LINE}-byte line limit")
    return data


def decode(line: bytes) -> Message:
    """One line (with or without its newline) -> Message, or ProtocolError."""
    if len(line) > MAX_LINE or (len(line) == MAX_LINE and not line.endswith(b"\n")):
        raise ProtocolError(f"line over {MAX_LINE} bytes")
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("not a JSON line") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a message is a JSON object")
    v = obj.pop("v", None)
    if v != VERSION:
        raise ProtocolError(f"protocol version {v!r} is not {VERSION}")
    kind = obj.pop("kind", None)
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind!r}")
    mid = obj.pop("id", None)
    if mid is not None and (not isinstance(mid, int) or isinstance(mid, bool)):
        raise ProtocolError("id: an integer")
    return Message(kind, obj, mid)


__all__ = ["ANSWERS", "DATA_CHUNK", "EVENTS", "KINDS", "MAX_LINE", "Message", "ProtocolError",
           "REQUESTS", "VERSION", "decode", "encode"]  # fmt: skip
