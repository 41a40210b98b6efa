"""Register rewrites for a fail injection, as pure functions over the 27
longs of struct user_regs_struct (pt_regs order first), so they can be
tested without a tracee."""

from __future__ import annotations

from collections.abc import Sequence

from .model import GF_NREGS, Injection
from .ptrace import REG

MASK64 = (1 << 64) - 1
# At the stop the probed first instruction has run (a push, a sub of a
# frame); a larger distance between entry sp and sp now means the stop is
# not the probed call (a stale entry meeting a genuine signal): refuse.
MAX_SP_DRIFT = 64 * 1024
IP, SP, AX, ORIG_AX = REG["ip"], REG["sp"], REG["ax"], REG["orig_ax"]


def check_skip(cur: Sequence[int], inj: Injection) -> str | None:
    """Why a skip rewrite must not be applied here, or None."""
    if len(inj.regs) != GF_NREGS:
        return f"injection has {len(inj.regs)} registers, expected {GF_NREGS}"
    drift = abs(cur[SP] - inj.regs[SP])
    if drift > MAX_SP_DRIFT:
        return f"sp moved {drift} bytes since entry: stop is not at the probed call"
    return None


def skip(cur: Sequence[int], inj: Injection, ret_addr: int) -> list[int]:
    """Return from the probed function without running its body.

    All general registers come from the entry snapshot (so callee-saved
    ones are as the caller left them), then the effect of a `ret`: ip =
    the return address read at entry sp at stop time (the uretprobe
    trampoline when one is attached), sp = entry sp + 8, ax = retval.
    Segment bases (fs_base, gs_base, ...) are not in pt_regs: keep them.
    """
    new = list(inj.regs)  # u64 values, as BPF recorded them
    new += cur[GF_NREGS:]
    new[IP] = ret_addr & MASK64
    new[SP] = (new[SP] + 8) & MASK64
    new[AX] = inj.retval & MASK64
    new[ORIG_AX] = MASK64  # -1: not in a syscall, so no restart
    return new


def after(cur: Sequence[int], inj: Injection) -> list[int]:
    """At the return site: replace the return value, nothing else.

    orig_ax = -1 as well: if the stop is at a syscall exit (the uretprobe
    syscall on 6.11+) and retval happens to equal -ERESTART*, the kernel
    would otherwise restart that syscall instead of returning retval.
    """
    new = list(cur)
    new[AX] = inj.retval & MASK64
    new[ORIG_AX] = MASK64
    return new
