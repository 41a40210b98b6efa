"""Steady-state probes: measure one thing, compare it with a tolerance.

An experiment file names probes as TOML tables; probe_from_toml() turns
one into a Probe whose sample() never raises: a probe that cannot measure
(connection refused, a command that times out) is a failed sample with the
reason in `detail`. Words as Chaos Toolkit and LitmusChaos users know them:

    [steady_state.probes.health]        # where = "exp.toml:steady_state.probes.health"
    kind = "http"                       # http | prometheus | metric | command | process | nvml
    mode = "continuous"                 # sot | eot | edge | continuous | onchaos
    url = "http://127.0.0.1:8000/health"
    json_path = "breaker.state"
    tolerance = "closed"
    timeout = "2s"                      # each attempt
    retries = 1                         # attempts after a failed one
    interval = "1s"                     # between attempts, and between continuous samples
    initial_delay = "0s"                # before the first sample (the runner waits it)

Modes (Litmus): sot = start of test (before the faults), eot = end of test,
edge = both, continuous = every `interval` for the whole experiment,
onchaos = every `interval` while a fault is active. The runner schedules
samples by mode, interval and initial_delay; a probe only measures.

Tolerances (Tolerance.from_toml): a value (`200`, `"closed"`, `true`), a
`[lo, hi]` range (inclusive), a comparison string (`"<= 0.2"`, `"> 5"`,
`"== closed"`, `"!= open"`), `{regex = "..."}` (re.search),
`{same_as = "first"}` (output agreement: equal to the probe's first
measured value), `{differs_from = "first"}` (its alert side: ok once a
value is not the first), and durations in comparisons or ranges
(`"<= 200ms"`, `["10ms", "1s"]`) compared in seconds. Every error in a
table is a ProbeError of one line naming where.key, what is wrong and
what to do.
"""

from __future__ import annotations

import http.client
import json
import math
import operator
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable
from urllib.parse import urlencode, urlsplit

from pyctl.exceptions import BadInput

MODES = ("sot", "eot", "edge", "continuous", "onchaos")
Value = float | str | None  # bool and int are accepted as numbers


class ProbeError(BadInput):
    """A bad probe table; str() is one line: where (file:key), what is
    wrong, what to do."""


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    value: Value  # what was measured (None when nothing could be)
    detail: str  # one line: what was measured and how it compares, or why not
    at: float  # time.time() of the measurement


# ---- tolerances ----------------------------------------------------------------

_CMP = re.compile(r"\s*(<=|>=|==|!=|<|>)\s*(.*?)\s*$")
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
}
_HAS_UNIT = re.compile(r"^\s*(\d+(\.\d*)?|\.\d+)\s*[a-z]")


def _duration(text: str) -> float | None:
    """Seconds of a duration text ('200ms', '1m30s'), None if it is not one."""
    from pyctl.spec import SpecError, parse_duration

    try:
        return parse_duration(text, allow_zero=True)
    except SpecError:
        return None


def _num(value: object) -> float | None:
    """A measured value as a number: numbers, numeric text, duration text."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return _duration(value) if _HAS_UNIT.match(value) else None
    return None


def _text(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


class Tolerance:
    """What a probe's value must be; see the module docstring for the forms."""

    def __init__(self, kind: str, operand: Any, op: str = "==", text: str = "") -> None:
        self.kind = kind  # "eq" | "cmp" | "range" | "regex" | "same"
        self.op = op
        self.operand = operand  # bool | float | str | (lo, hi) | re.Pattern
        self.text = text

    @classmethod
    def from_toml(cls, value: object, where: str) -> Tolerance:
        hint = (
            'use a value (200, "closed", true), a range [lo, hi], a comparison '
            '("<= 0.2", "> 5", "<= 200ms") or {regex = "..."}'
        )
        if isinstance(value, bool):
            return cls("eq", value, text=_text(value))
        if isinstance(value, (int, float)):
            return cls("eq", float(value), text=f"{value:g}")
        if isinstance(value, str):
            m = _CMP.match(value)
            if not m:
                return cls("eq", value, text=value)
            op, arg = m.group(1), m.group(2)
            if not arg:
                raise ProbeError(f"{where}: {value!r} compares with nothing: {hint}")
            n = _operand(arg)
            if n is None:
                if op not in ("==", "!="):
                    raise ProbeError(
                        f"{where}: {value!r}: {arg!r} is not a number or a duration, and"
                        f' text compares only with == or != (use e.g. "== closed")'
                    )
                return cls("cmp", arg, op, value)
            return cls("cmp", n, op, value)
        if isinstance(value, list):
            if len(value) != 2:
                raise ProbeError(f"{where}: a range is [lo, hi], got {len(value)} items: {hint}")
            bounds = []
            for v in value:
                b = None if isinstance(v, bool) else _operand(v) if isinstance(v, str) else v
                if not isinstance(b, (int, float)) or isinstance(b, bool):
                    raise ProbeError(
                        f"{where}: range bound {v!r} is not a number or a duration"
                        ' (use e.g. [200, 299] or ["10ms", "1s"])'
                    )
                bounds.append(float(b))
            lo, hi = bounds
            if lo > hi:
                raise ProbeError(f"{where}: range [{value[0]}, {value[1]}] has lo > hi: swap them")
            return cls("range", (lo, hi), text=f"in [{value[0]}, {value[1]}]")
        if isinstance(value, dict) and set(value) == {"differs_from"}:
            # The alert side of output agreement: ok once a value differs from
            # the first one (silent corruption that latency and errors miss).
            if value["differs_from"] != "first":
                raise ProbeError(f'{where}.differs_from: the only reference is "first"')
            return cls("differs", None, text="differs from the first sample")
        if isinstance(value, dict) and set(value) == {"same_as"}:
            # Output agreement: the first value measured is the reference and
            # every later one must equal it (a greedy completion sampled in
            # the baseline, compared while faults run: classes 10 and 11).
            if value["same_as"] != "first":
                raise ProbeError(f'{where}.same_as: the only reference is "first"')
            return cls("same", None, text="same as the first sample")
        if isinstance(value, dict):
            extra = set(value) - {"regex"}
            if extra or "regex" not in value:
                raise ProbeError(
                    f'{where}: a table tolerance is {{regex = "..."}}, got keys '
                    f"{sorted(value)}: {hint}"
                )
            pat = value["regex"]
            if not isinstance(pat, str):
                raise ProbeError(f"{where}.regex: expected a string, got {pat!r}")
            try:
                rx = re.compile(pat)
            except re.error as e:
                raise ProbeError(
                    f"{where}.regex: {pat!r} is not a regular expression: {e}"
                ) from None
            return cls("regex", rx, text=f"matches /{pat}/")
        raise ProbeError(f"{where}: {value!r} is not a tolerance: {hint}")

    def check(self, value: object) -> bool:
        if value is None:
            return False
        if self.kind in ("same", "differs"):
            if self.operand is None:
                self.operand = value  # the reference (a probe samples from one thread)
            return bool(value == self.operand) == (self.kind == "same")
        if self.kind == "regex":
            return self.operand.search(_text(value)) is not None
        if self.kind == "range":
            n = _num(value)
            return n is not None and not math.isnan(n) and self.operand[0] <= n <= self.operand[1]
        if self.kind == "eq":
            exp = self.operand
            if isinstance(exp, bool):
                if isinstance(value, bool):
                    return value == exp
                return _text(value).strip().lower() == _text(exp)
            if isinstance(exp, float):
                n = _num(value)
                return n is not None and n == exp
            if _text(value) == exp:
                return True
            a, b = _num(value), _num(exp)  # "200" vs 200.0
            return a is not None and b is not None and a == b
        # cmp
        if isinstance(self.operand, str):
            return _OPS[self.op](_text(value), self.operand)
        n = _num(value)
        return n is not None and not math.isnan(n) and _OPS[self.op](n, self.operand)

    def __str__(self) -> str:
        if self.kind == "eq":
            return f"== {self.text}"
        return self.text

    def __repr__(self) -> str:
        return f"Tolerance({self})"


def _operand(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return _duration(text) if _HAS_UNIT.match(text) else None


# ---- reading a TOML table ------------------------------------------------------

_REQUIRED = object()


class _Table:
    """Reads keys of one probe table, each checked, and refuses the rest."""

    def __init__(self, table: dict[str, Any], where: str, ignore: Collection[str]) -> None:
        self.t, self.where, self.used = table, where, set(ignore)

    def _missing(self, key: str, example: str) -> ProbeError:
        return ProbeError(f"{self.where}: missing key {key!r} (add e.g. {key} = {example})")

    def get(self, key: str, types: tuple[type, ...], example: str, default: Any = _REQUIRED) -> Any:
        self.used.add(key)
        if key not in self.t:
            if default is _REQUIRED:
                raise self._missing(key, example)
            return default
        v = self.t[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            want = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
            raise ProbeError(
                f"{self.where}.{key}: expected {want}, got {v!r} (e.g. {key} = {example})"
            )
        return v

    def choice(self, key: str, choices: Collection[str], default: str) -> str:
        v = self.get(key, (str,), f'"{default}"', default)
        if v not in choices:
            raise ProbeError(f"{self.where}.{key}: {v!r} is not one of {', '.join(choices)}")
        return v

    def duration(self, key: str, default: float, *, positive: bool = False) -> float:
        v = self.get(key, (str, int, float), '"2s"', None)
        if v is None:
            return default
        s = float(v) if isinstance(v, (int, float)) else _duration(v)
        if s is None or s < 0 or (positive and s == 0) or not math.isfinite(s):
            need = "longer than 0" if positive else "0 or longer"
            raise ProbeError(
                f'{self.where}.{key}: {v!r} is not a duration {need} (use e.g. "500ms", "2s")'
            )
        return s

    def tolerance(self, key: str, default: Any = _REQUIRED) -> Tolerance:
        self.used.add(key)
        if key not in self.t:
            if default is _REQUIRED:
                raise self._missing(key, '"<= 0.2"')
            return Tolerance.from_toml(default, self.where)
        return Tolerance.from_toml(self.t[key], f"{self.where}.{key}")

    def optional_tolerance(self, key: str) -> Tolerance | None:
        """A tolerance the table may leave out: None then (a separate method,
        so that a required or defaulted one is typed as never None)."""
        self.used.add(key)
        return self.tolerance(key) if key in self.t else None

    def strings(self, key: str, example: str) -> dict[str, str] | None:
        v = self.get(key, (dict,), example, None)
        if v is None:
            return None
        for k, x in v.items():
            if not isinstance(x, str):
                raise ProbeError(f"{self.where}.{key}.{k}: expected a string, got {x!r}")
        return dict(v)

    def finish(self) -> None:
        extra = sorted(set(self.t) - self.used)
        if extra:
            raise ProbeError(
                f"{self.where}: unknown key {extra[0]!r}: use one of {', '.join(sorted(self.used))}"
            )


_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    dict: "a table",
    list: "a list",
}


# ---- probes --------------------------------------------------------------------


@runtime_checkable
class Probe(Protocol):
    name: str
    mode: str  # "sot" | "eot" | "edge" | "continuous" | "onchaos"

    def sample(self) -> ProbeResult: ...


class _Probe:
    """Run properties as Litmus names them, and the retry loop."""

    kind: ClassVar[str] = ""

    def __init__(self, name: str, r: _Table) -> None:
        self.name = name
        self.where = r.where
        self.table = dict(r.t)  # as written, for the evidence
        self.mode = r.choice("mode", MODES, "edge")
        self.timeout = r.duration("timeout", 5.0, positive=True)
        self.retries = r.get("retries", (int,), "1", 0)
        if self.retries < 0:
            raise ProbeError(f"{r.where}.retries: {self.retries} must be 0 or more")
        self.interval = r.duration("interval", 1.0)
        self.initial_delay = r.duration("initial_delay", 0.0)

    def sample(self) -> ProbeResult:
        """1 + retries attempts, `interval` apart; the first ok one, else the last."""
        res = self._attempt()
        for i in range(self.retries):
            if res.ok:
                break
            time.sleep(self.interval)
            res = self._attempt()
            if not res.ok and i == self.retries - 1:
                res = ProbeResult(False, res.value, f"{res.detail} ({i + 2} attempts)", res.at)
        return res

    def _attempt(self) -> ProbeResult:
        at = time.time()
        try:
            ok, value, detail = self._measure()
        except Exception as e:  # noqa: BLE001 - a probe reports, never raises
            return ProbeResult(False, None, f"{self.kind} probe {self.name}: {_why(e)}", at)
        return ProbeResult(ok, value, detail, at)

    def _measure(self) -> tuple[bool, Value, str]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} mode={self.mode}>"


def _why(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _url(r: _Table, key: str, example: str) -> str:
    url = r.get(key, (str,), example)
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ProbeError(f"{r.where}.{key}: {url!r} is not an http(s) URL (use e.g. {example})")
    try:
        u.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ProbeError(f"{r.where}.{key}: {url!r} has a bad port (use e.g. {example})") from None
    return url


def _http(
    method: str,
    url: str,
    timeout: float,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One request on a fresh connection (a probe that reuses one would not
    see a server that stopped accepting)."""
    u = urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    if u.hostname is None:  # _url() refuses such a URL; this narrows str | None
        raise ProbeError(f"{url!r} has no host")
    conn = cls(u.hostname, u.port, timeout=timeout)
    try:
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        h = {"Connection": "close", **(headers or {})}
        if body is not None:
            h.setdefault("Content-Type", "application/json")
        conn.request(method, path, body, h)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


_PATH_PART = re.compile(r"\.?([A-Za-z_][\w-]*)|\[(\d+)\]|\[\"([^\"]*)\"\]")


def _json_path(path: str, where: str) -> list[str | int]:
    """'breaker.state', '$.choices[0].text', 'a["b.c"]' -> keys and indexes."""
    p = path[1:] if path.startswith("$") else path
    out: list[str | int] = []
    pos = 0
    while pos < len(p):
        m = _PATH_PART.match(p, pos)
        if not m or (pos == 0 and p.startswith(".") and path[0] != "$"):
            raise ProbeError(
                f'{where}: {path!r} is not a JSON path (use e.g. "breaker.state" or '
                f'"choices[0].text")'
            )
        out.append(m.group(1) or (int(m.group(2)) if m.group(2) else m.group(3)))
        pos = m.end()
    if not out:
        raise ProbeError(f'{where}: empty JSON path (use e.g. "breaker.state")')
    return out


def _walk(doc: Any, parts: list[str | int]) -> tuple[bool, Any]:
    for k in parts:
        if isinstance(k, int) and isinstance(doc, list) and k < len(doc):
            doc = doc[k]
        elif isinstance(k, str) and isinstance(doc, dict) and k in doc:
            doc = doc[k]
        else:
            return False, None
    return True, doc


def _scalar(v: Any) -> Value:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return json.dumps(v, sort_keys=True)


class HttpProbe(_Probe):
    """An HTTP request: status (default 200..299) and, optionally, a JSON
    path's value or the body text against `tolerance`."""

    kind = "http"

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        self.url = _url(r, "url", '"http://127.0.0.1:8000/health"')
        self.method = r.choice("method", ("GET", "POST", "PUT", "DELETE", "HEAD", "PATCH"), "GET")
        body = r.get("body", (str, dict, list), '"{}"', None)
        self.body = (
            None
            if body is None
            else body.encode()
            if isinstance(body, str)
            else json.dumps(body).encode()
        )
        self.headers = r.strings("headers", '{Authorization = "Bearer ..."}')
        self.status = r.tolerance("status", [200, 299])
        jp = r.get("json_path", (str,), '"breaker.state"', None)
        self.json_path = jp
        self._parts = _json_path(jp, f"{r.where}.json_path") if jp is not None else None
        self.tolerance = r.optional_tolerance("tolerance")
        if self._parts is not None and self.tolerance is None:
            raise ProbeError(
                f'{r.where}: json_path needs a tolerance (add e.g. tolerance = "closed")'
            )

    def _measure(self) -> tuple[bool, Value, str]:
        status, body = _http(self.method, self.url, self.timeout, self.body, self.headers)
        st_ok = self.status.check(status)
        what = f"{self.method} {self.url}: {status}"
        if not st_ok:
            what += f" (want {self.status})"
        if self._parts is not None:
            try:
                doc = json.loads(body)
            except ValueError:
                return False, None, f"{what}, answer is not JSON"
            found, v = _walk(doc, self._parts)
            if not found:
                return False, None, f"{what}, no {self.json_path} in the answer"
            v = _scalar(v)
            tol = self.tolerance
            if tol is None:  # __init__ refuses a json_path without one; this narrows the type
                raise ProbeError(f"{self.where}: json_path needs a tolerance")
            ok = tol.check(v)
            return (
                st_ok and ok,
                v,
                f"{what}, {self.json_path} = {v!r} ({_verdict(ok, tol)})",
            )
        if self.tolerance is not None:
            text = body.decode(errors="replace")
            ok = self.tolerance.check(text)
            short = text[:60] + ("..." if len(text) > 60 else "")
            return st_ok and ok, text, f"{what}, body {short!r} ({_verdict(ok, self.tolerance)})"
        return st_ok, status, what


def _verdict(ok: bool, tol: Tolerance) -> str:
    return f"{'ok' if ok else 'not'} {tol}"


class PrometheusProbe(_Probe):
    """A PromQL instant query through Prometheus's HTTP API (/api/v1/query):
    a scalar, or a vector of exactly one series, against `tolerance`."""

    kind = "prometheus"

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        self.url = _url(r, "url", '"http://127.0.0.1:9090"').rstrip("/")
        self.query = r.get("query", (str,), '"histogram_quantile(0.99, ...)"')
        if not self.query.strip():
            raise ProbeError(f"{r.where}.query: empty query (write a PromQL expression)")
        self.tolerance = r.tolerance("tolerance")

    def _measure(self) -> tuple[bool, Value, str]:
        url = f"{self.url}/api/v1/query?{urlencode({'query': self.query})}"
        status, body = _http("GET", url, self.timeout)
        try:
            doc = json.loads(body)
        except ValueError:
            return False, None, f"prometheus {self.url}: HTTP {status}, answer is not JSON"
        if doc.get("status") != "success":
            err = doc.get("error") or f"HTTP {status}"
            return (
                False,
                None,
                f"prometheus query {self.query!r}: {doc.get('errorType', 'error')}: {err}",
            )
        data = doc.get("data") or {}
        rtype = data.get("resultType")
        # Any, as JSON is: a result of the wrong shape raises below, a failed sample.
        result: Any = data.get("result")
        if rtype in ("scalar", "string"):
            v: Value = result[1] if rtype == "string" else float(result[1])
        elif rtype == "vector":
            if len(result) != 1:
                return (
                    False,
                    None,
                    (
                        f"prometheus query {self.query!r} returned {len(result)} series, want 1"
                        " (aggregate in PromQL, e.g. max(...) or sum(...))"
                    ),
                )
            v = float(result[0]["value"][1])
        else:
            return (
                False,
                None,
                f"prometheus query {self.query!r}: a {rtype} result (use an instant query)",
            )
        ok = self.tolerance.check(v)
        return ok, v, f"prometheus {self.query!r} = {v!r} ({_verdict(ok, self.tolerance)})"


class MetricProbe(_Probe):
    """One sample of a Prometheus text exposition (the service's /metrics),
    matched by name and labels; several matches need `aggregate`."""

    kind = "metric"
    AGGREGATES: ClassVar[dict[str, Callable[[list[float]], float]]] = {
        "sum": sum,
        "max": max,
        "min": min,
    }

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        self.url = _url(r, "url", '"http://127.0.0.1:8000/metrics"')
        self.metric = r.get("name", (str,), '"gf_service_breaker_state"')
        self.labels = r.strings("labels", '{kind = "device"}') or {}
        self.aggregate = r.choice("aggregate", ("only", *self.AGGREGATES), "only")
        self.tolerance = r.tolerance("tolerance")

    def _measure(self) -> tuple[bool, Value, str]:
        from prometheus_client.parser import text_string_to_metric_families

        status, body = _http("GET", self.url, self.timeout)
        if status != 200:
            return False, None, f"GET {self.url}: {status}"
        vals, names = [], set()
        for fam in text_string_to_metric_families(body.decode()):
            for s in fam.samples:
                names.add(s.name)
                if s.name == self.metric and all(
                    s.labels.get(k) == v for k, v in self.labels.items()
                ):
                    vals.append(float(s.value))
        sel = self.metric + (
            "{" + ",".join(f'{k}="{v}"' for k, v in self.labels.items()) + "}"
            if self.labels
            else ""
        )
        if not vals:
            near = sorted(n for n in names if n.startswith(self.metric.split("_")[0]))[:5]
            hint = f"; names there: {', '.join(near)}" if near else ""
            return False, None, f"{self.url}: no sample {sel}{hint}"
        if len(vals) > 1 and self.aggregate == "only":
            return (
                False,
                None,
                (f'{self.url}: {len(vals)} samples match {sel}: add labels or aggregate = "sum"'),
            )
        v = vals[0] if self.aggregate == "only" else self.AGGREGATES[self.aggregate](vals)
        ok = self.tolerance.check(v)
        return ok, v, f"{sel} = {v:g} ({_verdict(ok, self.tolerance)})"


class CommandProbe(_Probe):
    """A command's exit status (default 0) and, optionally, its stdout
    (stripped) against `tolerance`. Killed with its process group at timeout."""

    kind = "command"

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        cmd = r.get("command", (str, list), '"curl -sf http://127.0.0.1:8000/health"')
        self.shell = r.get("shell", (bool,), "true", False)
        if isinstance(cmd, list):
            if not cmd or not all(isinstance(c, str) for c in cmd):
                raise ProbeError(f'{r.where}.command: a list must hold strings (e.g. ["true"])')
            if self.shell:
                raise ProbeError(f"{r.where}.command: with shell = true, write one string")
            self.argv: list[str] | str = list(cmd)
        elif self.shell:
            self.argv = cmd
        else:
            try:
                self.argv = shlex.split(cmd)
            except ValueError as e:
                raise ProbeError(f"{r.where}.command: {cmd!r}: {e} (fix the quoting)") from None
        if not self.argv:
            raise ProbeError(f"{r.where}.command: empty command")
        self.cwd = r.get("cwd", (str,), '"/tmp"', None)
        self.env = r.strings("env", '{LC_ALL = "C"}')
        if not self.shell:
            prog = self.argv[0]
            found = os.access(prog, os.X_OK) if "/" in prog else shutil.which(prog)
            if not found:
                raise ProbeError(
                    f"{r.where}.command: {prog!r} is not an executable on PATH"
                    f" ({os.environ.get('PATH', '')}): give its full path or install it"
                )
        self.exit_status = r.tolerance("exit_status", 0)
        self.tolerance = r.optional_tolerance("tolerance")

    def _measure(self) -> tuple[bool, Value, str]:
        env = {**os.environ, **self.env} if self.env else None
        p = subprocess.Popen(
            self.argv,
            shell=self.shell,
            cwd=self.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = p.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            # Its own session: the group kill takes a shell's children too.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()
            return False, None, f"command {self.name}: timeout after {self.timeout:g}s (killed)"
        rc = p.returncode
        st_ok = self.exit_status.check(rc)
        what = f"exit {rc}" + ("" if st_ok else f" (want {self.exit_status})")
        if not st_ok and err.strip():
            what += f", stderr {err.decode(errors='replace').strip()[-120:]!r}"
        if self.tolerance is None:
            return st_ok, rc, f"command {self.name}: {what}"
        text = out.decode(errors="replace").strip()
        ok = self.tolerance.check(text)
        return (
            st_ok and ok,
            text,
            f"command {self.name}: {what}, stdout {text[:60]!r} ({_verdict(ok, self.tolerance)})",
        )


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a pid, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()  # comm may hold spaces and parens
    return rest[0], int(rest[19])


def _alive(ident: tuple[int, int] | None) -> bool:
    if ident is None:
        return False
    st = _stat(ident[0])
    return st is not None and st[0] not in ("Z", "X") and st[1] == ident[1]


class ProcessProbe(_Probe):
    """A process by pid, pidfile, name (/proc/PID/comm) or the experiment's
    target (target = true: the runner calls bind()). check = "alive"
    (default tolerance true), "restarts" (pid changes seen between samples
    since the first one, default "== 0"; a pidfile or a name), or
    "exit_status" (the target only: gpufault can read the status only of a
    process it started; a signal is -N as in subprocess)."""

    kind = "process"
    CHECKS: ClassVar[dict[str, object]] = {"alive": True, "restarts": "== 0", "exit_status": 0}

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        self.pid = r.get("pid", (int,), "1234", None)
        self.pidfile = r.get("pidfile", (str,), '"/run/svc.pid"', None)
        self.proc_name = r.get("name", (str,), '"gf-worker"', None)
        self.target = r.get("target", (bool,), "true", False)
        given = [
            k
            for k, v in (
                ("pid", self.pid),
                ("pidfile", self.pidfile),
                ("name", self.proc_name),
                ("target", self.target or None),
            )
            if v is not None
        ]
        if len(given) != 1:
            raise ProbeError(
                f"{r.where}: give exactly one of pid, pidfile, name, target = true"
                f" (got {', '.join(given) or 'none'})"
            )
        self.check = r.choice("check", tuple(self.CHECKS), "alive")
        if self.check == "restarts" and self.pidfile is None and self.proc_name is None:
            raise ProbeError(
                f"{r.where}.check: restarts are counted by the pid of a pidfile or a name"
                " (a fixed pid cannot restart): give pidfile or name"
            )
        if self.check == "exit_status" and not self.target:
            raise ProbeError(
                f"{r.where}.check: exit_status needs target = true (the exit status of a"
                " process gpufault did not start cannot be read)"
            )
        self.tolerance = r.tolerance("tolerance", self.CHECKS[self.check])
        self._popen: subprocess.Popen[Any] | None = None
        self._ident: tuple[int, int] | None = None  # (pid, start time) watched / last seen
        self.restarts = 0
        if self.pid is not None:
            self.bind(self.pid)

    def bind(self, pid: int, popen: subprocess.Popen[Any] | None = None) -> None:
        """The experiment's target (target = true): its pid, and its Popen
        when gpufault started it (for exit_status). The start time read now
        tells the process from a later one that reuses its pid."""
        self.pid, self._popen = pid, popen
        st = _stat(pid)
        self._ident = (pid, st[1] if st else -1)

    def _current(self) -> tuple[int, int] | None:
        """Who runs now: (pid, start time), None if no one."""
        if self.pidfile is not None:
            try:
                with open(self.pidfile) as f:
                    pid = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                return None
            st = _stat(pid)
            return (pid, st[1]) if st and st[0] not in ("Z", "X") else None
        if self.proc_name is not None:
            best = None
            for d in os.listdir("/proc"):
                if not d.isdigit():
                    continue
                try:
                    with open(f"/proc/{d}/comm") as f:
                        if f.read().rstrip("\n") != self.proc_name:
                            continue
                except OSError:
                    continue
                st = _stat(int(d))
                if st and st[0] not in ("Z", "X") and (best is None or st[1] < best[1]):
                    best = (int(d), st[1])  # the oldest of that name
            return best
        if self._popen is not None and self._popen.poll() is not None:
            return None  # reaped: its pid may be someone else's by now
        return self._ident if _alive(self._ident) else None

    def _measure(self) -> tuple[bool, Value, str]:
        who = self._who()
        if self._ident is None and self.pidfile is None and self.proc_name is None:
            return False, None, f"process {who}: target not bound yet (runner: call bind())"
        if self.check == "exit_status":
            if self._popen is None:
                return False, None, f"process {who}: exit status unknown (not started by gpufault)"
            rc = self._popen.poll()
            if rc is None:
                return False, None, f"process {who}: still running"
            ok = self.tolerance.check(rc)
            return ok, rc, f"process {who}: exited {rc} ({_verdict(ok, self.tolerance)})"
        cur = self._current()
        if self.check == "restarts":
            if cur is not None:
                if self._ident is not None and cur != self._ident:
                    self.restarts += 1
                self._ident = cur
            ok = self.tolerance.check(self.restarts)
            now = f"pid {cur[0]} running" if cur else "none running"
            return (
                ok,
                self.restarts,
                f"process {who}: {self.restarts} restarts, {now} ({_verdict(ok, self.tolerance)})",
            )
        alive = cur is not None
        ok = self.tolerance.check(alive)
        state = f"pid {cur[0]} alive" if cur else "not running"
        return ok, alive, f"process {who}: {state} ({_verdict(ok, self.tolerance)})"

    def _who(self) -> str:
        if self.pidfile is not None:
            return f"{self.name} (pidfile {self.pidfile})"
        if self.proc_name is not None:
            return f"{self.name} (name {self.proc_name})"
        return f"{self.name} (pid {self.pid})"


class NvmlProbe(_Probe):
    """NVML through pynvml (nvidia-ml-py): check = "memory_used" (bytes of
    device `device`) or "xids" (Xid critical-error events seen since the
    probe's first sample, default tolerance "== 0")."""

    kind = "nvml"
    CHECKS: ClassVar[dict[str, object]] = {"memory_used": _REQUIRED, "xids": "== 0"}

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        self.check = r.choice("check", tuple(self.CHECKS), "memory_used")
        self.device = r.get("device", (int,), "0", 0)
        dflt = self.CHECKS[self.check]
        self.tolerance = (
            r.tolerance("tolerance", dflt) if dflt is not _REQUIRED else r.tolerance("tolerance")
        )
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            raise ProbeError(
                f'{r.where}: kind "nvml" needs pynvml, which is not importable here:'
                " pip install nvidia-ml-py (gpufault's gpu extra) on a host with an NVIDIA"
                " driver, or drop this probe"
            ) from None
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            raise ProbeError(
                f"{r.where}: NVML does not start ({e}): is the NVIDIA driver loaded?"
            ) from None
        if not 0 <= self.device < n:
            raise ProbeError(f"{r.where}.device: {self.device} is not a GPU here (0..{n - 1})")
        self._h = pynvml.nvmlDeviceGetHandleByIndex(self.device)
        self._events: Any = None
        self.xids: list[int] = []

    def _measure(self) -> tuple[bool, Value, str]:
        nv = self._nv
        if self.check == "memory_used":
            used = int(nv.nvmlDeviceGetMemoryInfo(self._h).used)
            ok = self.tolerance.check(used)
            return (
                ok,
                used,
                f"GPU {self.device} memory used {used} B ({_verdict(ok, self.tolerance)})",
            )
        if self._events is None:
            # Registration starts the count: Xids before the first sample
            # are not this experiment's.
            self._events = nv.nvmlEventSetCreate()
            nv.nvmlDeviceRegisterEvents(self._h, nv.nvmlEventTypeXidCriticalError, self._events)
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        while True:
            try:
                ev = wait(self._events, 0)
            except nv.NVMLError as e:
                if getattr(e, "value", None) == nv.NVML_ERROR_TIMEOUT:
                    break
                raise
            if ev.eventType == nv.nvmlEventTypeXidCriticalError:
                self.xids.append(int(ev.eventData))
        n = len(self.xids)
        ok = self.tolerance.check(n)
        seen = f" ({', '.join(map(str, self.xids[-5:]))})" if n else ""
        return ok, n, f"GPU {self.device}: {n} Xids{seen} ({_verdict(ok, self.tolerance)})"


KINDS: dict[str, type[_Probe]] = {
    c.kind: c
    for c in (HttpProbe, PrometheusProbe, MetricProbe, CommandProbe, ProcessProbe, NvmlProbe)
}


def probe_from_toml(
    name: str, table: dict[str, Any], where: str, *, ignore: Collection[str] = ()
) -> Probe:
    """One probe from its TOML table. `where` is "FILE:KEY" of the table
    (e.g. "exp.toml:steady_state.probes.health"); `ignore` names keys the
    caller reads itself (a runner's own keys), which are then not refused."""
    if not isinstance(table, dict):
        raise ProbeError(f'{where}: a probe is a table (e.g. [probes.{name}] with kind = "http")')
    kind = table.get("kind")
    if kind is None:
        raise ProbeError(f"{where}: missing key 'kind' (add kind = one of {', '.join(KINDS)})")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProbeError(
            f"{where}.kind: {kind!r} is not a probe kind: use one of {', '.join(KINDS)}"
        )
    r = _Table(table, where, {"kind", *ignore})
    probe = KINDS[kind](name, r)
    r.finish()
    return probe
