"""Typed readers of an experiment file's values: every message names the
file and the key, says what is wrong and what to do (one ExperimentError
line). Shared by load.py, method.py, target.py and the step kinds.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pyctl.experiment.arrival import KINDS as ARRIVALS
from pyctl.experiment.arrival import Arrival, new_seed
from pyctl.experiment.model import CORPORA, ExperimentError, Header
from pyctl.experiment.probes import ProbeError, Tolerance
from pyctl.experiment.promptset import PromptSet, PromptSetError, read_prompt_set
from pyctl.spec import SpecError, parse_duration


class Reader:
    def __init__(self, where: str, base: Path | None = None) -> None:
        self.where = where
        self.base = base  # the file's directory: relative paths in it start there
        self.modes: dict[str, str] = {}  # probe name -> its mode (sot, continuous, ...)

    def err(self, key: str, what: str) -> ExperimentError:
        return ExperimentError(f"{self.where}: {key}: {what}")

    def table(
        self, doc: dict[str, Any], key: str, allowed: set[str], *, required: bool = False
    ) -> dict[str, Any]:
        v = doc.get(key.rsplit(".", 1)[-1])
        if v is None:
            if required:
                raise self.err(key, f"missing: add a [{key}] table")
            return {}
        if not isinstance(v, dict):
            raise self.err(key, f"expected a table, got {kind_name(v)}: write [{key}] or {{...}}")
        self.keys(v, key, allowed)
        return v

    def keys(self, d: dict[str, Any], key: str, allowed: set[str]) -> None:
        for k in d:
            if k not in allowed:
                raise self.err(
                    f"{key}.{k}" if key else k,
                    f"unknown key: remove it or use one of {', '.join(sorted(allowed))}",
                )

    def str_(self, d: dict[str, Any], key: str, name: str, default: str | None = None) -> str:
        v = d.get(name, default)
        if v is None:
            raise self.err(_join(key, name), "missing: give a string")
        if not isinstance(v, str):
            raise self.err(_join(key, name), f"expected a string, got {kind_name(v)} {v!r}")
        return v

    def int_(
        self, d: dict[str, Any], key: str, name: str, default: int | None = None, lo: int = 0
    ) -> int:
        v = d.get(name, default)
        if v is None:
            raise self.err(_join(key, name), "missing: give an integer")
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.err(_join(key, name), f"expected an integer, got {kind_name(v)} {v!r}")
        if v < lo:
            raise self.err(_join(key, name), f"{v} is below {lo}: give at least {lo}")
        return v

    def num(
        self,
        d: dict[str, Any],
        key: str,
        name: str,
        default: float | None = None,
        what: str = "a number",
    ) -> float:
        v = d.get(name, default)
        if v is None:
            raise self.err(_join(key, name), f"missing: give {what}")
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise self.err(_join(key, name), f"expected {what}, got {kind_name(v)} {v!r}")
        return float(v)

    def bool_(self, d: dict[str, Any], key: str, name: str, default: bool) -> bool:
        v = d.get(name, default)
        if not isinstance(v, bool):
            raise self.err(_join(key, name), f"expected true or false, got {kind_name(v)} {v!r}")
        return v

    def duration(
        self,
        d: dict[str, Any],
        key: str,
        name: str,
        default: Any = None,
        *,
        allow_zero: bool = False,
    ) -> float:
        v = d.get(name, default)
        k = _join(key, name)
        if v is None:
            raise self.err(k, 'missing: give a duration such as "5s" or "500ms"')
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise self.err(k, f'expected a duration such as "5s", got {kind_name(v)} {v!r}')
        try:
            return parse_duration(str(v), k, allow_zero=allow_zero)
        except SpecError as e:
            raise self.err(k, str(e).split(": ", 1)[-1]) from None

    def env(self, d: dict[str, Any], key: str, name: str) -> dict[str, str]:
        v = d.get(name, {})
        if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
            raise self.err(
                _join(key, name), 'expected a table of strings, e.g. {GF_DOUBLE_MEM_MIB = "24"}'
            )
        return dict(v)

    def command(self, d: dict[str, Any], key: str, name: str) -> list[str]:
        """A command as a list of words, or one string split like a shell
        would (no shell runs it: no expansion, no pipes)."""
        v = d.get(name)
        k = _join(key, name)
        if isinstance(v, str):
            try:
                words = shlex.split(v)
            except ValueError as e:
                raise self.err(k, f"cannot split {v!r} ({e}): fix the quoting") from None
        elif isinstance(v, list) and all(isinstance(w, str) for w in v):
            words = list(v)
        else:
            raise self.err(
                k, f"expected a command (a string or a list of strings), got {kind_name(v)}"
            )
        if not words:
            raise self.err(k, "empty command: give the program and its arguments")
        return words


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def kind_name(v: Any) -> str:
    return {
        bool: "boolean",
        int: "integer",
        float: "float",
        str: "string",
        list: "array",
        dict: "table",
    }.get(type(v), type(v).__name__)


# ---- bounds for the load generator's numbers (latency, error share, rate) ----------------


def parse_bound(text: Any, r: Reader, key: str, unit: str) -> Tolerance:
    """A load bound (`<= 200ms`, `< 1%`): the probes' one tolerance type."""
    try:
        return Tolerance.bound(text, unit)
    except ProbeError as e:
        raise r.err(key, str(e)) from None


LOAD_KEYS = {
    "rate",
    "prompt",
    "max_tokens",
    "timeout",
    "path",
    "concurrency",
    "corpus",
    "prompts",
    "context",
    "vocab_size",
    "max_len",
    "method",
    "url",
    "headers",
    "body",
    "stream",
    "arrival",
    "realtime",
}
METHODS = ("POST", "GET", "PUT", "PATCH")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Header names whose literal values are secrets: shown as <redacted> in the
# stored file (give them as {env = "VAR"} instead).
SECRET_HEADERS = re.compile(r"authorization|cookie|api[-_]?key|token|secret|password", re.I)


def load_fields(r: Reader, t: dict[str, Any], key: str) -> dict[str, Any]:
    """The keys [load] and a traffic step share."""
    rate = r.num(t, key, "rate", 10, "a number of requests per second")
    if not 0 < rate <= 10000:
        raise r.err(f"{key}.rate", f"{rate:g}: give 0 < rate <= 10000 requests per second")
    concurrency = r.int_(t, key, "concurrency", 64, lo=1)
    arrival = _arrival(r, t, key, rate, concurrency)
    if arrival is not None and arrival.mean_rate is not None:
        rate = arrival.mean_rate
    path = r.str_(t, key, "path", "/v1/completions")
    if not path.startswith("/"):
        raise r.err(f"{key}.path", f"{path!r}: give a path starting with /")
    prompts = t.get("prompts", [])
    prompt_set = None
    if isinstance(prompts, str):
        prompt_set = _prompt_file(r, t, key, prompts)
        prompts = [e.text for e in prompt_set.entries]
    if not isinstance(prompts, list) or not all(isinstance(x, str) for x in prompts):
        raise r.err(
            f"{key}.prompts",
            'expected a list of strings (sent in turn) or a JSONL file name ("prompts.jsonl")',
        )
    corpus = r.str_(t, key, "corpus", "prompts" if prompts else "prompt")
    if corpus not in CORPORA:
        raise r.err(f"{key}.corpus", f"{corpus!r}: use one of {', '.join(CORPORA)}")
    if corpus == "prompts" and not prompts:
        raise r.err(f"{key}.prompts", 'corpus "prompts" needs prompts = ["...", ...]')
    if prompts and corpus != "prompts":
        raise r.err(f"{key}.prompts", f'prompts are for corpus = "prompts", not {corpus!r}')
    method = r.str_(t, key, "method", "POST").upper()
    if method not in METHODS:
        raise r.err(f"{key}.method", f"{method!r}: use one of {', '.join(METHODS)}")
    url = t.get("url")
    if url is not None:
        u = urlsplit(url) if isinstance(url, str) else None
        if u is None or u.scheme not in ("http", "https") or not u.hostname:
            raise r.err(
                f"{key}.url",
                f"{url!r}: give a full http(s) URL (http://host:port/v1/chat/completions)",
            )
        if "path" in t:
            raise r.err(f"{key}.path", "give either url (a full endpoint) or path, not both")
    body = t.get("body")
    if body is not None:
        if not isinstance(body, dict):
            raise r.err(
                f"{key}.body",
                'expected a table, e.g. { messages = [{ role = "user", content = "$prompt" }] }',
            )
        if method == "GET":
            raise r.err(f"{key}.body", "a GET sends no body: remove it or use POST")
        if not mentions(body, "$prompt") and not mentions(body, "$messages"):
            raise r.err(
                f"{key}.body",
                'no "$prompt" in it: put "$prompt" where the prompt goes '
                '(or "$messages" where a chat list goes)',
            )
    if (
        prompt_set is not None
        and prompt_set.has_messages
        and not (body is not None and mentions(body, "$messages"))
    ):
        n = 1 + next(i for i, e in enumerate(prompt_set.entries) if e.messages is not None)
        raise r.err(
            f"{key}.prompts",
            f"{prompt_set.path}: entry {n} has chat messages: send them with a chat body, "
            'body = { messages = "$messages", max_tokens = "$max_tokens" }, to a chat url',
        )
    stream = r.bool_(t, key, "stream", False)
    return {
        "method": method,
        "url": url,
        "headers": _headers(r, t, key),
        "body": body,
        "stream": stream,
        "rate": rate,
        "prompt": r.str_(t, key, "prompt", "hello world"),
        "max_tokens": r.int_(t, key, "max_tokens", 4, lo=1),
        "timeout": r.duration(t, key, "timeout", "5s"),
        "path": path,
        "concurrency": arrival.clients if arrival and arrival.kind == "closed" else concurrency,
        "arrival": arrival,
        "prompt_set": prompt_set,
        "corpus": corpus,
        "prompts": list(prompts),
        "context": r.int_(t, key, "context", 256, lo=8),
        "vocab_size": r.int_(t, key, "vocab_size", 1000, lo=256),
        "max_len": r.int_(t, key, "max_len", 20000, lo=1),
        "realtime": _realtime(r, t, key),
    }


ARRIVAL_KEYS = {"kind", "seed", "size", "every", "clients"}
_ARRIVAL_HOW = (
    'expected "constant", "poisson" or a table: { kind = "poisson", seed = 7 }, '
    '{ kind = "burst", size = 20, every = "100ms" }, { kind = "closed", clients = 8 }'
)


def _arrival(
    r: Reader, t: dict[str, Any], key: str, rate: float, concurrency: int
) -> Arrival | None:
    """[load] arrival; None for the default (constant at `rate`). A poisson
    arrival without a seed gets a fresh one, written back into `t` (the
    stored file): the evidence then says how to repeat the run."""
    if "arrival" not in t:
        return None
    k = f"{key}.arrival"
    v = t["arrival"]
    if isinstance(v, str):
        v = {"kind": v}
    if not isinstance(v, dict):
        raise r.err(k, _ARRIVAL_HOW)
    r.keys(v, k, ARRIVAL_KEYS)
    kind = r.str_(v, k, "kind")
    if kind not in ARRIVALS:
        raise r.err(f"{k}.kind", f"{kind!r}: use one of {', '.join(ARRIVALS)}")
    allowed = {
        "constant": {"kind"},
        "poisson": {"kind", "seed"},
        "burst": {"kind", "size", "every"},
        "closed": {"kind", "clients"},
    }[kind]
    for x in v:
        if x not in allowed:
            raise r.err(f"{k}.{x}", f"not a key of a {kind} arrival: remove it")
    if kind in ("burst", "closed") and "rate" in t:
        why = "is size / every" if kind == "burst" else "is what the server answers"
        raise r.err(f"{key}.rate", f"a {kind} arrival's rate {why}: remove rate")
    if kind == "closed" and "concurrency" in t:
        raise r.err(f"{key}.concurrency", "a closed loop has one connection per client: "
                                          "remove concurrency, set arrival.clients")  # fmt: skip
    if kind == "constant":
        return Arrival("constant", rate=rate)
    if kind == "poisson":
        if "seed" in v:
            return Arrival("poisson", rate=rate, seed=r.int_(v, k, "seed", lo=0))
        seed = new_seed()
        t["arrival"] = {**v, "seed": seed}
        return Arrival("poisson", rate=rate, seed=seed, drawn=True)
    if kind == "burst":
        size = r.int_(v, k, "size", lo=1)
        every = r.duration(v, k, "every")
        if size > concurrency:
            raise r.err(
                f"{k}.size",
                f"a burst of {size} needs as many connections: set concurrency >= {size} "
                f"(it is {concurrency})",
            )
        if not 0 < size / every <= 10000:
            raise r.err(k, f"{size / every:g} requests/s: give size / every <= 10000")
        return Arrival("burst", size=size, every=every)
    return Arrival("closed", clients=r.int_(v, k, "clients", lo=1))


def read_set(r: Reader, name: str, where: str) -> PromptSet:
    """A JSONL prompt set named in the file (relative to its directory),
    read and checked now; its errors are `where`'s one line."""
    p = Path(name)
    if not p.is_absolute() and r.base is not None:
        p = r.base / p
    try:
        return read_prompt_set(p)
    except PromptSetError as e:
        raise r.err(where, str(e)) from None


def _prompt_file(r: Reader, t: dict[str, Any], key: str, name: str) -> PromptSet:
    """prompts = "file.jsonl" (relative to the experiment file's directory),
    read and checked now, at validate time; its digest goes into the
    stored file."""
    if not name:
        raise r.err(f"{key}.prompts", "an empty file name: give the JSONL file")
    ps = read_set(r, name, f"{key}.prompts")
    t["prompts_file"] = {"path": ps.path, "sha256": ps.sha256, "entries": len(ps.entries)}
    return ps


def _realtime(r: Reader, t: dict[str, Any], key: str) -> bool | str:
    """realtime = true (SCHED_FIFO, else a short slice), "slice" (only the
    unprivileged short slice) or false (normal threads): loadgen._realtime."""
    v = t.get("realtime", True)
    if v not in (True, False, "slice") or isinstance(v, int) and not isinstance(v, bool):
        raise r.err(f"{key}.realtime", f'{v!r}: give true, false or "slice"')
    return v  # type: ignore[no-any-return]


def mentions(v: Any, word: str) -> bool:
    if isinstance(v, str):
        return word in v
    if isinstance(v, dict):
        return any(mentions(x, word) for x in v.values())
    if isinstance(v, list):
        return any(mentions(x, word) for x in v)
    return False


def _headers(r: Reader, t: dict[str, Any], key: str) -> dict[str, Header]:
    raw = t.get("headers", {})
    k = f"{key}.headers"
    if not isinstance(raw, dict):
        raise r.err(k, 'expected a table, e.g. { Authorization = { env = "API_TOKEN" } }')
    out: dict[str, Header] = {}
    for name, v in raw.items():
        hk = f"{k}.{name}"
        if not _HEADER_NAME.fullmatch(name):
            raise r.err(hk, "not a header name: letters, digits and -")
        if name.lower() in ("host", "content-length", "transfer-encoding", "connection"):
            raise r.err(hk, "the load generator sets this header itself: remove it")
        if isinstance(v, str):
            if any(c in v for c in "\r\n\0"):
                raise r.err(hk, "a header value is one line")
            out[name] = Header(value=v)
            continue
        if not isinstance(v, dict):
            raise r.err(hk, 'expected a string or { env = "VAR", prefix = "Bearer " }')
        r.keys(v, hk, {"env", "prefix"})
        env = r.str_(v, hk, "env")
        if not _ENV_NAME.fullmatch(env):
            raise r.err(f"{hk}.env", f"{env!r} is not an environment variable name")
        prefix = r.str_(v, hk, "prefix", "")
        if any(c in prefix for c in "\r\n\0"):
            raise r.err(f"{hk}.prefix", "a header value is one line")
        out[name] = Header(env=env, prefix=prefix)
    return out


def redact_headers(doc: dict[str, Any]) -> dict[str, Any]:
    """The file's content as stored: literal values of secret-looking
    headers ([load] and traffic steps) replaced by "<redacted>"."""

    def fix(t: Any) -> Any:
        if not isinstance(t, dict) or not isinstance(t.get("headers"), dict):
            return t
        hs = {
            n: "<redacted>" if isinstance(v, str) and SECRET_HEADERS.search(n) else v
            for n, v in t["headers"].items()
        }
        return {**t, "headers": hs}

    out = dict(doc)
    if "load" in out:
        out["load"] = fix(out["load"])
    if isinstance(out.get("method"), list):
        out["method"] = [
            {**m, "traffic": fix(m["traffic"])} if isinstance(m, dict) and "traffic" in m else m
            for m in out["method"]
        ]
    return out


__all__ = [
    "LOAD_KEYS",
    "METHODS",
    "Reader",
    "kind_name",
    "load_fields",
    "mentions",
    "read_set",
    "parse_bound",
    "redact_headers",
]
