"""The fault spec: where x what x when x who x how long x what to capture.

Parsing and validation live here (pure Python, unit-tested); the BPF side
gets a packed abi.Spec from to_bpf().
"""

from __future__ import annotations

import errno as _errno
import os
import re
import signal as _signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from pyctl.bpf import abi
from pyctl.exceptions import BadInput


class SpecError(BadInput):
    """A malformed spec; str() is a one-line message that says what to do."""


SIGNALS = {"SIGSEGV", "SIGBUS", "SIGABRT", "SIGKILL", "SIGILL", "SIGFPE", "SIGTERM", "SIGUSR1"}


# The most user stack the BPF side copies at a fire (bpf/gpufault.h).
STACK_COPY_MAX = abi.USTACK_PAGES * abi.USTACK_PAGE


def check_stack_copy(n: int, what: str = "--stack-copy") -> int:
    """A stack copy size in bytes: 0 (none) up to STACK_COPY_MAX; the BPF
    side copies whole 4 KiB pages, so it is rounded up to one."""
    if not 0 <= n <= STACK_COPY_MAX:
        raise SpecError(
            f"{what}: {n} bytes is outside 0..{STACK_COPY_MAX // 1024}K, what the BPF side "
            f"copies: give at most {STACK_COPY_MAX // 1024}K (0: frame pointers only)"
        )
    return n


def parse_int(text: str, what: str) -> int:
    """Decimal, hex (0x), with _ separators and K/M/G (binary) suffixes."""
    t = str(text).strip().replace("_", "")
    m = re.fullmatch(r"(-?)(0x[0-9a-fA-F]+|\d+)([KMG]i?B?|)", t)
    if not m:
        raise SpecError(f"{what}: {text!r} is not a number (use e.g. 3, 0x10, 200M)")
    v = int(m.group(2), 0)
    unit = m.group(3)[:1].upper()
    v <<= {"": 0, "K": 10, "M": 20, "G": 30}[unit]
    return -v if m.group(1) else v


U64_MAX = 2**64 - 1
S64_MIN = -(2**63)
# The longest time a spec's deadline, window or stall may hold: the BPF side
# adds it to a u64 CLOCK_MONOTONIC in ns, so keep far below 2**64 ns (584 y).
MAX_DURATION_S = 10 * 365 * 86400.0

class _LazyRe:
    """A pattern compiled at its first use: the four of this module were
    ~1.5 ms of every start, and a plain trace's uses none of them."""

    def __init__(self, pattern: str, flags: int = 0) -> None:
        self._args = (pattern, flags)
        self._re: re.Pattern[str] | None = None

    def __getattr__(self, name: str) -> Any:
        if self._re is None:
            self._re = re.compile(*self._args)
        return getattr(self._re, name)


_DUR_PART = _LazyRe(r"(\d+(?:\.\d*)?|\.\d+)\s*(ns|us|ms|s|m|h|d)")
_DUR_SCALE = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(
    text: str | float, what: str = "--duration", *, allow_zero: bool = False
) -> float:
    """'30s', '500ms', '2m', '2h', '1m30s', '1h2m3.5s', '1.5' (seconds) -> seconds.

    A number (a TOML value) is seconds. Zero is refused unless allow_zero
    (a zero --duration used to mean 'forever', a zero --stall a hang: both
    have their own spelling, omit the option)."""
    t = str(text).strip()
    hint = "use e.g. 30s, 500ms, 2m, 1m30s, 2h"
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        total = float(text)
        if total != total or total < 0:  # nan, or negative: not a length of time
            raise SpecError(f"{what}: {text!r} is not a duration ({hint})")
    elif re.fullmatch(r"\d+(?:\.\d*)?|\.\d+", t):
        total = float(t)
    else:
        pos, total, units = 0, 0.0, []
        for m in _DUR_PART.finditer(t):
            if m.start() != pos and t[pos : m.start()].strip():
                break
            total += float(m.group(1)) * _DUR_SCALE[m.group(2)]
            units.append(m.group(2))
            pos = m.end()
        if not units or t[pos:].strip() or len(set(units)) != len(units):
            raise SpecError(f"{what}: {text!r} is not a duration ({hint})")
    if not allow_zero and total <= 0:
        instead = "for a hang" if what == "--stall" else "for no limit"
        raise SpecError(f"{what}: {text!r} must be longer than 0 (omit {what} {instead})")
    if total > MAX_DURATION_S:
        raise SpecError(f"{what}: {text!r} is too long (at most 10 years, e.g. 3650d)")
    return total


def check_range(value: int, what: str, lo: int, hi: int) -> int:
    """Refuse a number its BPF field cannot hold (ctypes would wrap it)."""
    if not lo <= value <= hi:
        raise SpecError(f"{what}: {value} is out of range (use {lo} .. {hi})")
    return value


def parse_prob(text: str | float) -> int:
    """'5%', '0.05', '50000ppm' (or the number 0.05) -> parts per million."""
    t = str(text).strip()
    try:
        if isinstance(text, (int, float)) and not isinstance(text, bool):
            v = float(text)
        elif t.endswith("%"):
            v = float(t[:-1]) / 100
        elif t.endswith("ppm"):
            v = float(t[:-3]) / 1e6
        else:
            v = float(t)
    except ValueError:
        raise SpecError(
            f"--prob: {text!r} is not a probability (use 5%, 0.05 or 50000ppm)"
        ) from None
    if not 0 < v <= 1:
        raise SpecError(f"--prob: {text!r} must be in (0, 1]")
    return max(1, round(v * 1_000_000))


# errno values a fail may set: Linux's are 1 .. 133 (EHWPOISON); anything
# up to 4095 is what the kernel's -errno returns can be.
ERRNO_MAX = 4095


def parse_errno(text: str | int, what: str = "--errno") -> int:
    """An errno value: a name (EIO, eio) or a number 1 .. 4095."""
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        t = str(text).strip()
        if re.fullmatch(r"\d+", t):
            n = int(t)
        else:
            code = getattr(_errno, t.upper(), None)
            if not isinstance(code, int) or not t.upper().startswith("E"):
                raise SpecError(
                    f"{what}: unknown errno {text!r} (use a name such as EIO, ENOMEM, EAGAIN, "
                    "or a number 1 .. 4095)"
                )
            n = code
    if not 1 <= n <= ERRNO_MAX:
        raise SpecError(f"{what}: {n} is out of range (use a name such as EIO or 1 .. 4095)")
    return n


def errno_name(n: int) -> str:
    """'EIO (5)'; a number Linux has no name for stays a number."""
    name = _errno.errorcode.get(n)
    return f"{name} ({n})" if name else str(n)


def parse_signal(name: str, what: str = "--signal") -> int:
    """A real signal: a name (SIGSEGV, segv, SIGRTMIN+2) or a number 1..64.
    Not SIG_IGN/SIG_DFL (handler constants that happen to be 0 and 1)."""
    t = str(name).strip()
    if re.fullmatch(r"\d+", t):
        n = int(t)
        if 1 <= n <= 64:
            return n
        raise SpecError(f"{what}: signal number {n} is out of range (use 1 .. 64 or a name)")
    u = t.upper()
    if not u.startswith("SIG"):
        u = "SIG" + u
    m = re.fullmatch(r"SIGRT(MIN|MAX)([+-]\d+)?", u)
    if m:
        base = int(_signal.SIGRTMIN if m.group(1) == "MIN" else _signal.SIGRTMAX)
        n = base + int(m.group(2) or 0)
        if int(_signal.SIGRTMIN) <= n <= int(_signal.SIGRTMAX):
            return n
    elif u in _signal.Signals.__members__:
        return int(_signal.Signals[u])
    raise SpecError(
        f"{what}: unknown signal {name!r} (use a name such as SIGSEGV, SIGBUS, SIGABRT, "
        "or a number 1 .. 64)"
    )


_PRED = _LazyRe(r"\s*arg([1-6])\s*(==|!=|<=|>=|<|>|&)\s*(\S+)\s*$")


def parse_predicate(text: str) -> tuple[int, int, int]:
    m = _PRED.match(text)
    if not m:
        raise SpecError(
            f"--when: {text!r} is not a predicate (use argN OP VALUE, OP one of "
            "== != < > <= >= &, e.g. 'arg2>=200M')"
        )
    val = check_range(parse_int(m.group(3), "--when"), "--when value", S64_MIN, U64_MAX)
    return int(m.group(1)), abi.PRED_OPS[m.group(2)], val & U64_MAX


_CORRUPT = _LazyRe(
    r"\s*arg([1-6])(?:\+(\w+))?\s*(?::\s*(zero|xor|set)(?:=(\S+))?)?(?::(\d))?\s*$"
)


def parse_corrupt(text: str) -> tuple[int, int, int, int, int]:
    """'arg1:zero', 'arg1+8:xor=0x1:4' -> (arg, off, op, mask, len)."""
    m = _CORRUPT.match(text)
    if not m:
        raise SpecError(
            f"--corrupt: {text!r} is not a target (use argN[+OFF][:zero|xor=MASK|set=V][:LEN], "
            "e.g. arg1:zero for *dptr)"
        )
    arg = int(m.group(1))
    off = parse_int(m.group(2), "--corrupt offset") if m.group(2) else 0
    check_range(off, "--corrupt offset", 0, 2**32 - 1)
    op = abi.CORRUPT_OPS[m.group(3) or "zero"]
    mask = 0
    if m.group(4):
        value = parse_int(m.group(4), "--corrupt value")
        mask = check_range(value, "--corrupt value", S64_MIN, U64_MAX) & U64_MAX
    if op != abi.CORRUPT_OPS["zero"] and m.group(4) is None:
        raise SpecError(f"--corrupt: {text!r} needs a value (xor=0x1, set=0)")
    ln = int(m.group(5)) if m.group(5) else 8
    if ln not in (1, 2, 4, 8):
        raise SpecError(f"--corrupt: length {ln} must be 1, 2, 4 or 8 bytes")
    return arg, off, op, mask, ln


# The fields of FaultSpec.from_fields: `gpufault inject`'s option names
# (underscored), which a template's [[fault]] table uses too.
FIELDS = frozenset({
    "lib", "fn", "action", "ret", "mode", "signal", "corrupt", "stall", "nth", "every", "after",
    "max", "prob", "sticky", "when", "window", "trace", "no_stack", "entry_only", "caller",
    "errno",
})  # fmt: skip

# (catalog library name, code text) -> value; pyctl.catalog.code_value by default.
CodeLookup = Callable[[str, str], int]

_FLOAT = _LazyRe(r"\s*[-+]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][-+]?\d+|inf|nan)\s*", re.I)


class ReturnCode(NamedTuple):
    """A --ret value as the CLI read it: `value` for a number, None for a
    code name, which only the library (--lib) can resolve."""

    value: int | None
    text: str


def parse_code(text: str, what: str = "--ret") -> ReturnCode:
    """A number (2, -1, 0x10) in one 64-bit register, or a code name left
    for resolve_code; a float is refused (it is neither)."""
    try:
        v = parse_int(text, what)
    except SpecError:
        if _FLOAT.fullmatch(str(text)):
            raise SpecError(
                f"{what}: {text!r} is not an integer: give an integer (2, -1, 0x10) or a code name"
            ) from None
        return ReturnCode(None, str(text).strip())
    # One 64-bit register: -2**63 .. 2**64-1 (ctypes would wrap the rest).
    return ReturnCode(check_range(v, what, S64_MIN, U64_MAX), str(text))


def catalog_library(lib: str) -> str:
    """Whose return codes a name means: the catalog's library for what --lib
    says (a soname, a path or a short name); CUDA's when it is none of them."""
    # lazy: keeps pyctl.catalog (+13 modules) off `trace --help` and `import gpufault`
    from pyctl import catalog

    # lazy: keeps pyctl.catalog.libraries (+13 modules) off `trace --help` and `import gpufault`
    from pyctl.catalog.libraries import library

    name = catalog.lib_for_soname(lib)
    if name is None:
        try:
            name = library(os.path.basename(lib)).name
        except ValueError:
            name = "cuda"
    return name


def resolve_code(
    value: Any, lib: str, *, catalog: CodeLookup | None = None, what: str = "--ret"
) -> tuple[int | None, str]:
    """The one lookup of a return value: (value, the text it was given as).
    A number stays a number; a name is looked up in the catalog of `lib`."""
    if value is None:
        return None, ""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, str(value)
    code = value if isinstance(value, ReturnCode) else parse_code(str(value), what)
    if code.value is not None:
        return code.value, code.text
    try:
        lookup: CodeLookup
        if catalog is None:
            # lazy: the catalog only for a code given by name (an ImportError: numbers only)
            from pyctl.catalog import code_value as lookup
        else:
            lookup = catalog
        return int(lookup(catalog_library(lib), code.text)), code.text
    except ImportError:
        raise SpecError(f"{what}: {code.text!r} is not a number") from None
    except (ValueError, KeyError) as e:
        raise SpecError(f"{what}: {e}") from None


def _count(v: Any, what: str) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else parse_int(str(v), what)


def _signal_of(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else parse_signal(str(v))


def _parsed(v: Any, parse: Callable[[str], Any]) -> Any:
    """None, an already parsed tuple, or text for `parse`."""
    if v in (None, ""):
        return None
    return tuple(v) if isinstance(v, (tuple, list)) else parse(str(v))


@dataclass
class FaultSpec:
    lib: str
    fn: str | list[str]  # a name or glob, or several (each must match)
    action: str = "observe"
    ret: int | None = None
    ret_text: str = ""
    mode: str = "skip"
    signo: int = 0
    nth: int = 0
    every: int = 0
    after: int = 0
    max_fires: int = 0
    prob_ppm: int = 0
    sticky: bool = False
    window_start_s: float = 0.0
    duration_s: float = 0.0
    pred: tuple[int, int, int] | None = None
    corrupt: tuple[int, int, int, int, int] | None = None
    stall_ms: float = 0.0
    trace: bool = False
    entry_only: bool = False  # trace entries only (no return probe: half the cost)
    capture_stack: bool = True
    tgid: int = 0
    tid: int = 0
    caller: str = ""  # only calls returning into this object (callers.py)
    errno: int = 0  # fail: also set the thread's errno to this (0: leave it)

    @classmethod
    def from_fields(
        cls, fields: Mapping[str, Any], *, catalog: CodeLookup | None = None
    ) -> FaultSpec:
        """The one spec builder: `gpufault inject`'s options, a template's
        [[fault]] table and an experiment file's fault all come here.

        `fields` uses the option names (FIELDS: lib, fn, action, ret, signal,
        max, prob, when, window, stall, no_stack, ...). A value may be text
        as a user typed it ("5%", "1m30s", "SIGSEGV", "arg2>=200M"), a TOML
        value (3, 0.05, true) or what the CLI's value types already made of
        it (pyctl/cli/options.py); all are read by the parsers above, so a
        spelling means the same everywhere. `catalog` looks up return-code
        names (default: pyctl.catalog). Returns a validated spec; raises
        SpecError naming the option."""
        unknown = set(fields) - FIELDS
        if unknown:
            raise SpecError(f"unknown field(s) {', '.join(sorted(unknown))}")
        f = {k: v for k, v in fields.items() if v is not None}
        for req in ("lib", "fn"):
            if not f.get(req):
                raise SpecError(f"needs {req}")
        lib = str(f["lib"])
        fns = [str(f["fn"])] if isinstance(f["fn"], str) else list(dict.fromkeys(map(str, f["fn"])))
        ret, ret_text = resolve_code(f.get("ret"), lib, catalog=catalog)
        stall, window = f.get("stall"), f.get("window")
        spec = cls(
            lib=lib,
            fn=fns[0] if len(fns) == 1 else fns,
            action=str(f.get("action") or "observe"),
            ret=ret,
            ret_text=ret_text,
            mode=str(f.get("mode") or "skip"),
            signo=_signal_of(f["signal"]) if f.get("signal") else 0,
            nth=_count(f.get("nth", 0), "--nth"),
            every=_count(f.get("every", 0), "--every"),
            after=_count(f.get("after", 0), "--after"),
            max_fires=_count(f.get("max", 0), "--max"),
            prob_ppm=parse_prob(f["prob"]) if f.get("prob") not in (None, "", 0) else 0,
            sticky=bool(f.get("sticky", False)),
            window_start_s=parse_duration(window, "--window", allow_zero=True) if window else 0.0,
            pred=_parsed(f.get("when"), parse_predicate),
            corrupt=_parsed(f.get("corrupt"), parse_corrupt),
            stall_ms=parse_duration(stall, "--stall") * 1000 if stall not in (None, "") else 0.0,
            trace=bool(f.get("trace", False)),
            entry_only=bool(f.get("entry_only", False)),
            capture_stack=not f.get("no_stack", False),
            caller=str(f.get("caller") or ""),
            errno=parse_errno(f["errno"]) if f.get("errno") not in (None, "", 0) else 0,
        )
        return spec.validate()

    def validate(self) -> FaultSpec:
        if self.action not in abi.ACTIONS:
            raise SpecError(
                f"--action: {self.action!r} unknown (use observe, fail, signal, corrupt, stall)"
            )
        if self.mode not in ("skip", "after"):
            raise SpecError(f"--mode: {self.mode!r} unknown (use skip or after)")
        if self.action == "fail" and self.ret is None:
            raise SpecError("--action fail needs --ret (a number or a code name, e.g. --ret 2)")
        if self.action == "signal" and not self.signo:
            raise SpecError("--action signal needs --signal (e.g. --signal SIGSEGV)")
        if self.action == "corrupt" and self.corrupt is None:
            raise SpecError("--action corrupt needs --corrupt (e.g. --corrupt arg1:zero)")
        if self.errno:
            if self.action != "fail":
                raise SpecError(
                    f"--errno goes with --action fail (a failed call's errno), not "
                    f"{self.action}: e.g. --action fail --ret -1 --errno EIO"
                )
            parse_errno(self.errno)
        for name in ("nth", "every", "after", "max_fires"):
            if getattr(self, name) < 0:
                raise SpecError(f"--{name.replace('_fires', '')} must not be negative")
            # u64 fields in the BPF spec: 2**64 + 1 would wrap to 1.
            check_range(getattr(self, name), f"--{name.replace('_fires', '')}", 0, U64_MAX)
        if self.ret is not None:
            if not isinstance(self.ret, int) or isinstance(self.ret, bool):
                raise SpecError(f"--ret: {self.ret!r} is not an integer (use e.g. 2, -1, 0x10)")
            # One 64-bit register: signed or unsigned spelling of it.
            check_range(self.ret, "--ret", S64_MIN, U64_MAX)
        if self.signo and not 1 <= self.signo <= 64:
            raise SpecError(f"--signal: {self.signo} is not a signal number (use 1 .. 64)")
        if self.stall_ms < 0:
            raise SpecError("--stall must not be negative")
        for what, secs in (("--stall", self.stall_ms / 1000), ("--window", self.window_start_s),
                           ("--duration", self.duration_s)):  # fmt: skip
            if secs > MAX_DURATION_S:
                raise SpecError(f"{what}: {secs:g}s is too long (at most 10 years)")
        if not isinstance(self.fn, str) and not self.fn:
            raise SpecError("--fn: give at least one function name or glob")
        self.check_can_fire(self.duration_s)
        return self

    def check_can_fire(self, duration_s: float = 0.0) -> None:
        """Refuse triggers no call can ever meet: the run would attach, wait
        and end with nothing, as if the target never failed. duration_s:
        the run's --duration where the spec has none of its own."""
        if self.action == "observe":
            return  # triggers do not apply (start_notes says so)
        if self.nth and self.every and self.nth % self.every:
            raise SpecError(
                f"--nth {self.nth} with --every {self.every}: call {self.nth} is not a "
                f"multiple of {self.every}, so no call can fire: give one of the two"
            )
        if self.nth and self.after and self.nth <= self.after:
            raise SpecError(
                f"--nth {self.nth} with --after {self.after}: call {self.nth} comes before "
                f"call {self.after + 1}, so no call can fire: give one of the two"
            )
        dur = self.duration_s or duration_s
        if self.window_start_s and dur and self.window_start_s >= dur:
            raise SpecError(
                f"--window {self.window_start_s:g}s starts when --duration {dur:g}s has "
                "ended, so no call can fire: give a --window shorter than --duration"
            )

    @property
    def fn_text(self) -> str:
        return self.fn if isinstance(self.fn, str) else ",".join(self.fn)

    def describe(self) -> str:
        bits = [f"{self.action}"]
        if self.action == "fail":
            bits.append(f"ret={self.ret_text or self.ret} mode={self.mode}")
            if self.errno:
                bits.append(f"errno={_errno.errorcode.get(self.errno, self.errno)}")
        if self.action == "signal":
            try:
                bits.append(_signal.Signals(self.signo).name)
            except ValueError:  # 32, 33: glibc's own, unnamed in Python
                bits.append(f"signal {self.signo}")
        if self.action == "stall":
            bits.append(f"{self.stall_ms:g}ms" if self.stall_ms else "hang")
        for k in ("nth", "every", "after", "max_fires"):
            if getattr(self, k):
                bits.append(f"{k}={getattr(self, k)}")
        if self.prob_ppm:
            bits.append(f"prob={self.prob_ppm / 1e4:g}%")
        if self.sticky:
            bits.append("sticky")
        if self.caller:
            bits.append(f"caller={self.caller}")
        if self.pred:
            op = {v: k for k, v in abi.PRED_OPS.items()}[self.pred[1]]
            bits.append(f"arg{self.pred[0]}{op}{self.pred[2]:#x}")
        return f"{self.lib}:{self.fn_text} " + " ".join(bits)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def to_bpf(
        self,
        *,
        start_mono_ns: int | None = None,
        tgid: int = 0,
        tid: int = 0,
        duration_s: float = 0.0,
    ) -> abi.Spec:
        """The packed BPF spec. tgid, tid and duration_s are the run's target
        and --duration (pyctl/runner.py's RunOptions, through the engine):
        they apply where the spec sets none of its own, so a run never
        writes its target into the caller's specs. How the kernel carries it
        out (register writes or the copilot, a return probe) is the run's
        plan's to add: pyctl/engine/mechanism.py Plan.bpf_spec."""
        now = (
            start_mono_ns
            if start_mono_ns is not None
            else time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        )
        s = abi.Spec()
        s.action = abi.ACTIONS[self.action]
        flags = abi.F_ENABLED
        if self.sticky:
            flags |= abi.F_STICKY
        if self.mode == "after":
            flags |= abi.F_AFTER
        if self.trace:
            flags |= abi.F_TRACE
        if self.capture_stack:
            # Frame pointers (the kernel's walk) and the copy CFI unwinds.
            flags |= abi.F_CAP_STACK | abi.F_CAP_USTACK
        s.flags = flags
        r = self.ret or 0
        s.retval = r - 2**64 if r > 2**63 - 1 else r  # the unsigned spelling of a negative
        s.tgid, s.tid = self.tgid or tgid, self.tid or tid
        s.nth, s.every, s.after, s.max_fires = self.nth, self.every, self.after, self.max_fires
        s.prob_ppm = self.prob_ppm
        s.signo = self.signo
        if self.window_start_s:
            s.window_start_ns = now + int(self.window_start_s * 1e9)
        if self.duration_s or duration_s:
            s.deadline_ns = now + int((self.duration_s or duration_s) * 1e9)
        if self.pred:
            s.pred_arg, s.pred_op, s.pred_val = self.pred
        if self.corrupt:
            (s.corrupt_arg, s.corrupt_off, s.corrupt_op, s.corrupt_mask, s.corrupt_len) = (
                self.corrupt
            )
        s.stall_ns = int(self.stall_ms * 1e6)
        if self.action == "fail" and self.errno:
            # A fail's corrupt fields are unused in BPF (corrupt_arg 0), and BPF
            # copies corrupt_mask into the copilot's pending entry as it is:
            # the errno the copilot writes rides there (bpf/gpufault.h).
            s.corrupt_mask = self.errno
        return s
