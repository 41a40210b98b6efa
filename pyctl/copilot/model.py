"""The copilot's data: what BPF asks for (Injection) and what happened (Outcome)."""

from __future__ import annotations

from dataclasses import dataclass

from pyctl.exceptions import GpufaultError

# Mirrors of bpf/gpufault.h (enum gf_action, enum gf_spec_flags).
GF_ACT_FAIL = 1
GF_ACT_STALL = 4
GF_F_AFTER = 1 << 2
GF_NREGS = 21


class CopilotError(GpufaultError):
    """A one-line, user-facing message (what went wrong and what to do)."""


@dataclass(frozen=True)
class Injection:
    """What BPF left in the "pending" map for one thread (struct gf_pending)."""

    fault_seq: int
    regs: tuple[int, ...]  # 21 longs, struct pt_regs order (r15 ... ss)
    retval: int
    stall_ns: int
    deadline_ns: int  # CLOCK_MONOTONIC ns (bpf_ktime_get_ns); 0 = none
    action: int  # GF_ACT_FAIL or GF_ACT_STALL
    flags: int  # GF_F_AFTER: fail at the return site instead of skipping the body
    errno: int = 0  # fail: also store this in the thread's errno (0: leave it)


@dataclass
class Outcome:
    """One per handled injection, for the evidence store."""

    tid: int
    fault_seq: int
    action: int
    stop_ns: int  # CLOCK_MONOTONIC when the tracer saw the stop
    resume_ns: int  # CLOCK_MONOTONIC when the thread was resumed (0: never)
    ip_before: int  # ip at the stop
    ip_after: int  # ip the thread resumed at
    ret_addr: int  # skip mode: the word read at entry sp (the return address)
    error: str | None
    errno: int = 0  # the errno value stored with a fail (0: none asked for)
    errno_addr: int = 0  # where: the thread's errno (fs_base + its TLS offset)
