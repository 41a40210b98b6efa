"""What a campaign runs against: one small interface over the real
libraries, a user's callable, or an HTTP endpoint.

`--target` forms:
  hf                 a byte-level BPE trained in-process (tokenizers)
  tiktoken           a tiktoken Encoding built from generated ranks
  module:callable    an object with .encode(str) (and maybe .decode), or a
                     plain callable str -> list[int]; a zero-argument factory
                     is called once to build it
  http://host:port/p POST {"text": ...} -> {"ids": [...]} (stdlib http.client)
"""

from __future__ import annotations

import http.client
import importlib
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

from pyctl.exceptions import BadInput
from pyctl.tokenizer import builders


class TargetError(BadInput):
    """The target answered in a way that is not a tokenization (HTTP 5xx,
    bad JSON). Distinct from exceptions the tokenizer itself raises."""


class TargetRejected(BadInput):
    """The endpoint refused the input with a 4xx: a clean rejection."""


class Target(Protocol):
    name: str
    specials: dict[str, int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text, or None when this target cannot decode."""
        ...


class HFTarget:
    """A `tokenizers.Tokenizer`. add_special_tokens=False: the campaigns
    compare content ids; the truncation campaign sets its own options."""

    def __init__(self, tok: Any, name: str = "hf") -> None:
        self.tok = tok
        self.name = name
        self.specials = {
            t: i for t, i in tok.get_vocab(with_added_tokens=True).items() if t.startswith("[")
        }

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str | None:
        return str(self.tok.decode(list(ids), skip_special_tokens=False))


class TiktokenTarget:
    """A `tiktoken.Encoding` with tiktoken's defaults: special-token text
    in the input raises ValueError (disallowed_special='all')."""

    def __init__(self, enc: Any, name: str = "tiktoken") -> None:
        self.enc = enc
        self.name = name
        self.specials = {t: enc.encode_single_token(t) for t in enc.special_tokens_set}

    def encode(self, text: str) -> list[int]:
        return list(self.enc.encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(x) for x in self.enc.encode_ordinary_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str | None:
        return str(self.enc.decode(list(ids)))


class CallableTarget:
    def __init__(self, obj: Any, name: str) -> None:
        self.name = name
        self.specials: dict[str, int] = dict(getattr(obj, "specials", {}) or {})
        if hasattr(obj, "encode"):
            self._encode: Callable[[str], Sequence[int]] = obj.encode
            self._decode: Callable[[Sequence[int]], str] | None = getattr(obj, "decode", None)
        elif callable(obj):
            self._encode = obj
            self._decode = None
        else:
            raise TypeError(f"{name} is neither callable nor has .encode")
        self.obj = obj

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self._decode is None else str(self._decode(list(ids)))


class HttpTarget:
    """POST JSON {"text": ...} to the URL, expect {"ids": [...]}. One
    connection per thread (http.client connections are not thread-safe)."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"bad endpoint {url!r}: use http://host:port/path")
        self.name = url
        self.specials: dict[str, int] = {}
        self.scheme = u.scheme
        self.host = u.hostname
        self.port = u.port
        self.path = u.path or "/"
        self.timeout = timeout

        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            cls = (
                http.client.HTTPSConnection
                if self.scheme == "https"
                else http.client.HTTPConnection
            )
            c = cls(self.host, self.port, timeout=self.timeout)
            self._local.conn = c
        return c

    def encode(self, text: str) -> list[int]:
        # surrogatepass: lone surrogates reach the service as the invalid
        # UTF-8 they would be on the wire from a sloppy client.
        body = json.dumps({"text": text}, ensure_ascii=False).encode("utf-8", "surrogatepass")
        c = self._conn()
        try:
            c.request("POST", self.path, body, {"Content-Type": "application/json"})
            resp = c.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            c.close()
            self._local.conn = None
            raise TargetError(f"endpoint error: {e}") from e
        if 400 <= resp.status < 500:
            raise TargetRejected(f"HTTP {resp.status}: {data[:200]!r}")
        if resp.status != 200:
            raise TargetError(f"HTTP {resp.status}: {data[:200]!r}")
        try:
            ids = json.loads(data)["ids"]
        except (ValueError, KeyError, TypeError) as e:
            raise TargetError(f"bad reply {data[:200]!r}: want JSON {{'ids': [...]}}") from e
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str | None:
        return None


def load_callable(spec: str) -> Any:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"bad target {spec!r}: use module:callable")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"cannot import {mod_name!r} for target {spec!r}: {e}") from e
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{mod_name} has no attribute {attr!r} (target {spec!r})")
        obj = getattr(obj, part)
    return obj


def resolve_target(spec: str, *, vocab_size: int = 1000, cache_capacity: int | None = None) -> Any:
    """Build the target named by `--target` (see the module doc)."""
    if spec == "hf":
        return HFTarget(builders.build_hf_bpe(vocab_size, cache_capacity=cache_capacity))
    if spec == "tiktoken":
        return TiktokenTarget(builders.build_tiktoken())
    if spec.startswith(("http://", "https://")):
        return HttpTarget(spec)
    if spec.startswith("pid:"):
        raise ValueError(
            f"{spec}: a running pid is probe-only; use `gpufault tokenizer observe --pid N`"
        )
    obj = load_callable(spec)
    # A class or a zero-argument factory builds the tokenizer once.
    if isinstance(obj, type) or (callable(obj) and getattr(obj, "_gpufault_factory", False)):
        obj = obj()
    return CallableTarget(obj, spec)
