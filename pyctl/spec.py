"""The fault spec: where x what x when x who x how long x what to capture.

Parsing and validation live here (pure Python, unit-tested); the BPF side
gets a packed abi.Spec from to_bpf().
"""

from __future__ import annotations

import re
import signal as _signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pyctl.bpf import abi


class SpecError(ValueError):
    """A malformed spec; str() is a one-line message that says what to do."""


SIGNALS = {"SIGSEGV", "SIGBUS", "SIGABRT", "SIGKILL", "SIGILL", "SIGFPE", "SIGTERM", "SIGUSR1"}


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


def parse_duration(text: str, what: str = "--duration") -> float:
    """'30s', '500ms', '2m', '1.5' (seconds) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h|)\s*", str(text))
    if not m:
        raise SpecError(f"{what}: {text!r} is not a duration (use e.g. 30s, 500ms, 2m)")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0, "m": 60.0, "h": 3600.0}[m.group(2)]
    return float(m.group(1)) * scale


def parse_prob(text: str) -> int:
    """'5%', '0.05', '50000ppm' -> parts per million."""
    t = str(text).strip()
    try:
        if t.endswith("%"):
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


def parse_signal(name: str) -> int:
    n = name.upper()
    if not n.startswith("SIG"):
        n = "SIG" + n
    try:
        return int(getattr(_signal, n))
    except AttributeError:
        raise SpecError(
            f"--signal: unknown signal {name!r} (e.g. SIGSEGV, SIGBUS, SIGABRT)"
        ) from None


_PRED = re.compile(r"\s*arg([1-6])\s*(==|!=|<=|>=|<|>|&)\s*(\S+)\s*$")


def parse_predicate(text: str) -> tuple[int, int, int]:
    m = _PRED.match(text)
    if not m:
        raise SpecError(
            f"--when: {text!r} is not a predicate (use argN OP VALUE, OP one of "
            "== != < > <= >= &, e.g. 'arg2>=200M')"
        )
    return int(m.group(1)), abi.PRED_OPS[m.group(2)], parse_int(m.group(3), "--when") & (2**64 - 1)


_CORRUPT = re.compile(
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
    op = abi.CORRUPT_OPS[m.group(3) or "zero"]
    mask = parse_int(m.group(4), "--corrupt mask") & (2**64 - 1) if m.group(4) else 0
    if op != abi.CORRUPT_OPS["zero"] and m.group(4) is None:
        raise SpecError(f"--corrupt: {text!r} needs a value (xor=0x1, set=0)")
    ln = int(m.group(5)) if m.group(5) else 8
    if ln not in (1, 2, 4, 8):
        raise SpecError(f"--corrupt: length {ln} must be 1, 2, 4 or 8 bytes")
    return arg, off, op, mask, ln


@dataclass
class FaultSpec:
    lib: str
    fn: str
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
    extra: dict[str, Any] = field(default_factory=dict)

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
        for name in ("nth", "every", "after", "max_fires"):
            if getattr(self, name) < 0:
                raise SpecError(f"--{name.replace('_fires', '')} must not be negative")
        if self.stall_ms < 0:
            raise SpecError("--stall must not be negative")
        return self

    @property
    def needs_copilot_always(self) -> bool:
        return self.action == "stall"

    def describe(self) -> str:
        bits = [f"{self.action}"]
        if self.action == "fail":
            bits.append(f"ret={self.ret_text or self.ret} mode={self.mode}")
        if self.action == "signal":
            bits.append(_signal.Signals(self.signo).name)
        if self.action == "stall":
            bits.append(f"{self.stall_ms:g}ms" if self.stall_ms else "hang")
        for k in ("nth", "every", "after", "max_fires"):
            if getattr(self, k):
                bits.append(f"{k}={getattr(self, k)}")
        if self.prob_ppm:
            bits.append(f"prob={self.prob_ppm / 1e4:g}%")
        if self.sticky:
            bits.append("sticky")
        if self.pred:
            op = {v: k for k, v in abi.PRED_OPS.items()}[self.pred[1]]
            bits.append(f"arg{self.pred[0]}{op}{self.pred[2]:#x}")
        return f"{self.lib}:{self.fn} " + " ".join(bits)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def to_bpf(
        self, *, mech_regs: bool, retprobe: bool, start_mono_ns: int | None = None
    ) -> abi.Spec:
        now = (
            start_mono_ns
            if start_mono_ns is not None
            else time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        )
        s = abi.Spec()
        s.action = abi.ACTIONS[self.action]
        flags = abi.F_ENABLED | abi.F_CAP_REGS
        if self.sticky:
            flags |= abi.F_STICKY
        if self.mode == "after":
            flags |= abi.F_AFTER
        if self.trace:
            flags |= abi.F_TRACE
        if self.capture_stack:
            flags |= abi.F_CAP_STACK
        if retprobe:
            flags |= abi.F_RETPROBE
        if self.action in ("fail", "stall"):
            flags |= abi.F_REGS if (mech_regs and self.action == "fail") else abi.F_COPILOT
        s.flags = flags
        s.retval = self.ret or 0
        s.tgid, s.tid = self.tgid, self.tid
        s.nth, s.every, s.after, s.max_fires = self.nth, self.every, self.after, self.max_fires
        s.prob_ppm = self.prob_ppm
        s.signo = self.signo
        if self.window_start_s:
            s.window_start_ns = now + int(self.window_start_s * 1e9)
        if self.duration_s:
            s.deadline_ns = now + int(self.duration_s * 1e9)
        if self.pred:
            s.pred_arg, s.pred_op, s.pred_val = self.pred
        if self.corrupt:
            (s.corrupt_arg, s.corrupt_off, s.corrupt_op, s.corrupt_mask, s.corrupt_len) = (
                self.corrupt
            )
        s.stall_ns = int(self.stall_ms * 1e6)
        return s
