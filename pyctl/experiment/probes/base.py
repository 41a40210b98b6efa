"""What every probe kind shares: the checked reader of its TOML table, the
run properties (mode, timeout, retries, interval, initial_delay), the retry
loop, and how the target's facts get in.

A probe is parsed once, when the experiment file is loaded: every key is
read and checked then, against stand-in facts for placeholders such as
`{url}`. The probe keeps what was written; once the target runs,
`with_facts(facts)` returns the run's copy with the facts filled into the
fields a kind names in FACT_FIELDS, and fresh run state (no second parse).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable
from urllib.parse import urlsplit

from pyctl.experiment.facts import render_facts, stand_ins
from pyctl.experiment.probes.tolerance import ProbeError, Tolerance, _duration

MODES = ("sot", "eot", "edge", "continuous", "onchaos")
Value = float | str | None  # bool and int are accepted as numbers


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    value: Value  # what was measured (None when nothing could be)
    detail: str  # one line: what was measured and how it compares, or why not
    at: float  # time.time() of the measurement


# ---- reading a TOML table ------------------------------------------------------

_REQUIRED = object()


class _Table:
    """Reads keys of one probe table, each checked, and refuses the rest.
    Checked with stand-ins for the target's facts (t); a kind that lets a
    key hold facts reads it as written (facts=True) and names it in its
    FACT_FIELDS."""

    def __init__(self, table: dict[str, Any], where: str, ignore: Collection[str]) -> None:
        self.raw, self.where, self.used = table, where, set(ignore)
        self.t = render_facts(copy.deepcopy(table), stand_ins(table))

    def stand_in(self, v: Any) -> Any:
        """A value read with facts=True as it will look once facts are in."""
        return render_facts(copy.deepcopy(v), stand_ins(v))

    def _missing(self, key: str, example: str) -> ProbeError:
        return ProbeError(f"{self.where}: missing key {key!r} (add e.g. {key} = {example})")

    def get(
        self,
        key: str,
        types: tuple[type, ...],
        example: str,
        default: Any = _REQUIRED,
        *,
        facts: bool = False,
    ) -> Any:
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
        return copy.deepcopy(self.raw[key]) if facts else v

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

    def strings(self, key: str, example: str, *, facts: bool = False) -> dict[str, str] | None:
        v = self.get(key, (dict,), example, None)
        if v is None:
            return None
        for k, x in v.items():
            if not isinstance(x, str):
                raise ProbeError(f"{self.where}.{key}.{k}: expected a string, got {x!r}")
        return dict(self.raw[key]) if facts else dict(v)

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
    table: dict[str, Any]  # as written (knobs in, facts once with_facts filled them)

    def sample(self) -> ProbeResult: ...

    def with_facts(self, facts: dict[str, Any]) -> Probe: ...


class _Probe:
    """Run properties as Litmus names them, and the retry loop."""

    kind: ClassVar[str] = ""
    # Attributes that may hold target facts as written ("{url}/health"):
    # filled in by with_facts().
    FACT_FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str, r: _Table) -> None:
        self.name = name
        self.where = r.where
        self.table = copy.deepcopy(r.raw)  # as written, for the evidence
        self.mode = r.choice("mode", MODES, "edge")
        self.timeout = r.duration("timeout", 5.0, positive=True)
        self.retries = r.get("retries", (int,), "1", 0)
        if self.retries < 0:
            raise ProbeError(f"{r.where}.retries: {self.retries} must be 0 or more")
        self.interval = r.duration("interval", 1.0)
        self.initial_delay = r.duration("initial_delay", 0.0)

    def with_facts(self, facts: dict[str, Any]) -> Any:
        """This probe for one run: the target's facts in its FACT_FIELDS,
        its tolerances and run state fresh. Nothing is parsed again."""
        p = copy.copy(self)
        for field in ("table", *self.FACT_FIELDS):
            setattr(p, field, render_facts(copy.deepcopy(getattr(self, field)), facts))
        for k, v in list(vars(p).items()):
            if isinstance(v, Tolerance):
                setattr(p, k, v.fresh())
        p._reset()
        return p

    def _reset(self) -> None:
        """Run state as before a first sample (kinds that keep some override it)."""

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
    """A URL as written (it may hold {url}), checked as it will be."""
    url = r.get(key, (str,), example, facts=True)
    u = urlsplit(str(r.stand_in(url)))
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ProbeError(f"{r.where}.{key}: {url!r} is not an http(s) URL (use e.g. {example})")
    try:
        u.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ProbeError(f"{r.where}.{key}: {url!r} has a bad port (use e.g. {example})") from None
    return url


def _verdict(ok: bool, tol: Tolerance) -> str:
    return f"{'ok' if ok else 'not'} {tol}"
