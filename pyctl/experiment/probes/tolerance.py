"""The one tolerance type: what a measured value must be. Probes compare
their value with one (Tolerance.from_toml), and the load hypothesis's
bounds (`p99 = "<= 200ms"`, `error_rate = "<= 1%"`) are the same type
(Tolerance.bound), so a comparison reads and prints one way everywhere.

Forms: a value (`200`, `"closed"`, `true`), a `[lo, hi]` range
(inclusive), a comparison string (`"<= 0.2"`, `"> 5"`, `"== closed"`,
`"!= open"`), `{regex = "..."}` (re.search), `{same_as = "first"}`
(output agreement: equal to the probe's first measured value),
`{differs_from = "first"}` (its alert side: ok once a value is not the
first), and durations in comparisons or ranges (`"<= 200ms"`,
`["10ms", "1s"]`) compared in seconds.
"""

from __future__ import annotations

import copy
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from pyctl.exceptions import BadInput


class ProbeError(BadInput):
    """A bad probe table; str() is one line: where (file:key), what is
    wrong, what to do."""


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
    # lazy: pyctl.spec (ctypes, +6 modules) only when this runs
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

    @classmethod
    def bound(cls, text: object, unit: str) -> Tolerance:
        """A bound of the load hypothesis: `<= 200ms`, `< 0.05`, `>= 5`. unit
        "duration": the number is a duration; otherwise a number or a
        percentage. A ProbeError says what is wrong (the caller adds where)."""
        # lazy: pyctl.spec (ctypes, +6 modules) only when this runs
        from pyctl.spec import SpecError, parse_duration

        if not isinstance(text, str):
            raise ProbeError(f'expected a comparison such as "<= 200ms", got {text!r}')
        m = re.fullmatch(r"\s*(<=|<|>=|>)\s*(\S+)\s*", text)
        if not m:
            raise ProbeError(f'{text!r} is not a comparison: write e.g. "<= 200ms" or "< 0.01"')
        op, val = m.groups()
        try:
            if unit == "duration":
                x = parse_duration(val, allow_zero=True)
            elif val.endswith("%"):
                x = float(val[:-1]) / 100
            else:
                x = float(val)
        except (SpecError, ValueError):
            want = "a duration such as 200ms" if unit == "duration" else "a number or a percentage"
            raise ProbeError(f"{val!r} is not {want}") from None
        return cls("cmp", x, op, text.strip())

    def fresh(self) -> Tolerance:
        """A copy for a new run: same_as / differs_from forget their reference."""
        t = copy.copy(self)
        if t.kind in ("same", "differs"):
            t.operand = None
        return t

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
