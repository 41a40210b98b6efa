"""A user's prompt set: a JSONL file, one request per line.

    {"prompt": "Translate: ka tu ro", "max_tokens": 16, "reference": " sa sa"}
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "hello"}]}

Each line is one JSON object with `prompt` (a string) or `messages` (an
OpenAI chat list of {role, content}), and optionally `max_tokens` (this
request's, instead of [load]'s) and `reference` (the expected output, for
[quality] probes). Nothing else: a misspelt key is refused, not ignored.

gpufault runs as root and the file is named by whoever wrote the
experiment, so it is opened the way sudo opens a file it did not create:
O_NOFOLLOW (a symbolic link as the last component is refused), O_NONBLOCK
(a FIFO cannot hang the open), checked on the open descriptor to be a
regular file, read up to MAX_BYTES only. Every problem is one line with
the file and the line number.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from pyctl.exceptions import BadInput
from pyctl.safefile import SafeFileError, read_checked

MAX_BYTES = 32 * 1024 * 1024  # a prompt set, not a data set: 32 MiB
MAX_LINES = 100_000
KEYS = ("prompt", "messages", "max_tokens", "reference")
ROLES = ("system", "user", "assistant", "developer", "tool")


class PromptSetError(BadInput):
    """One line: the file, the line, what is wrong, what to do."""


@dataclass(frozen=True)
class PromptEntry:
    prompt: str | None = None  # a completion's prompt, or
    messages: tuple[tuple[str, str], ...] | None = None  # a chat's (role, content)
    max_tokens: int | None = None
    reference: str | None = None

    @property
    def text(self) -> str:
        """The prompt as text: `prompt`, or the last user message's content
        (what "$prompt" in a body template is filled with)."""
        if self.prompt is not None:
            return self.prompt
        users = [c for r, c in self.messages or () if r == "user"]
        return users[-1] if users else ""

    def chat(self) -> list[dict[str, str]]:
        """The OpenAI messages list ("$messages" in a body template); a
        prompt line is one user message."""
        if self.messages is None:
            return [{"role": "user", "content": self.prompt or ""}]
        return [{"role": r, "content": c} for r, c in self.messages]


@dataclass(frozen=True)
class PromptSet:
    path: str
    entries: tuple[PromptEntry, ...]
    sha256: str  # of the bytes read: the evidence says which file ran

    @property
    def has_messages(self) -> bool:
        return any(e.messages is not None for e in self.entries)


def read_prompt_set(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES) -> PromptSet:
    p = os.fspath(path)
    data = _read(p, max_bytes)
    entries: list[PromptEntry] = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue  # blank lines (a trailing newline) carry nothing
        if len(entries) >= MAX_LINES:
            raise PromptSetError(f"{p}: line {n}: over {MAX_LINES} prompts: use fewer")
        entries.append(_entry(p, n, raw))
    if not entries:
        raise PromptSetError(
            f'{p}: no prompts in it: one JSON object per line, {{"prompt": "..."}}'
        )
    return PromptSet(p, tuple(entries), hashlib.sha256(data).hexdigest())


def _read(p: str, max_bytes: int) -> bytes:
    try:
        return read_checked(p, max_bytes)
    except SafeFileError as e:
        raise PromptSetError(f"{p}: {_WHY[e.why].format(d=e.detail, max=max_bytes)}") from None


# SafeFileError.why -> this reader's words
_WHY = {
    "link": "is a symbolic link: name the file itself",
    "open": "cannot open it ({d}): check the path",
    "type": "not a regular file: give a JSONL file",
    "size": "{d} bytes, over the {max} byte limit: use a smaller set",
    "read": "cannot read it ({d})",
}


def parse_messages(m: Any, name: str) -> tuple[tuple[str, str], ...]:
    """An OpenAI chat list, checked: a non-empty list of {role, content}
    with a known role and a string content (ValueError says what is wrong,
    `name` first: a JSONL line and a TOML case word it their own way)."""
    if not isinstance(m, list) or not m:
        raise ValueError(f'{name}: expected a non-empty list of {{"role", "content"}}')
    out = []
    for i, x in enumerate(m, 1):
        if (
            not isinstance(x, dict)
            or set(x) != {"role", "content"}
            or x["role"] not in ROLES
            or not isinstance(x["content"], str)
        ):
            raise ValueError(
                f'{name}[{i}]: expected {{"role": one of {", ".join(ROLES)}, "content": a string}}'
            )
        out.append((x["role"], x["content"]))
    return tuple(out)


def _entry(p: str, n: int, raw: bytes) -> PromptEntry:
    def bad(what: str) -> PromptSetError:
        return PromptSetError(f"{p}: line {n}: {what}")

    try:
        obj: Any = json.loads(raw)
    except UnicodeDecodeError:
        raise bad("not UTF-8: write the file as UTF-8") from None
    except ValueError as e:
        msg = str(e).split(":")[0]
        raise bad(f"not JSON ({msg}): one JSON object per line") from None
    if not isinstance(obj, dict):
        raise bad('expected a JSON object, e.g. {"prompt": "..."}')
    for k in obj:
        if k not in KEYS:
            raise bad(f"unknown key {k!r}: use {', '.join(KEYS)}")
    if ("prompt" in obj) == ("messages" in obj):
        raise bad('give "prompt" (a string) or "messages" (a chat list), one of them')
    prompt = obj.get("prompt")
    if "prompt" in obj and not isinstance(prompt, str):
        raise bad('"prompt": expected a string')
    messages = None
    if "messages" in obj:
        try:
            messages = parse_messages(obj["messages"], '"messages"')
        except ValueError as e:
            raise bad(str(e)) from None
    mt = obj.get("max_tokens")
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        raise bad(f'"max_tokens": {mt!r}: give an integer >= 1')
    ref = obj.get("reference")
    if ref is not None and not isinstance(ref, str):
        raise bad('"reference": expected a string (the output the answer should be)')
    return PromptEntry(prompt=prompt, messages=messages, max_tokens=mt, reference=ref)


__all__ = [
    "MAX_BYTES",
    "PromptEntry",
    "PromptSet",
    "PromptSetError",
    "parse_messages",
    "read_prompt_set",
]
