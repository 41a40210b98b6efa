"""The engine's side of the copilot: what BPF left in the "pending" map
for a stopped thread, as an Injection (a corrupt fault's write done here,
through /proc/TID/mem, while the thread is held), and the copilot started
with it. pyctl/engine wires it; the tracer (tracer.py) never reads maps."""

from __future__ import annotations

import ctypes as C
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyctl.bpf import abi
from pyctl.bpf.raw import map_lookup_and_delete_held

from .model import Injection, Outcome
from .tracer import Copilot


@dataclass
class CorruptOutcome:
    fault_seq: int
    tid: int
    addr: int
    error: str | None


def write_corruption(tid: int, p: abi.Pending) -> str | None:
    """Apply a corrupt fault's write through /proc/TID/mem (thread stopped)."""
    n = p.corrupt_len if p.corrupt_len in (1, 2, 4, 8) else 8
    try:
        fd = os.open(f"/proc/{tid}/mem", os.O_RDWR)
    except OSError as e:
        return f"open /proc/{tid}/mem: {e.strerror}"
    try:
        old = int.from_bytes(os.pread(fd, 8, p.corrupt_addr).ljust(8, b"\0"), "little")
        if p.corrupt_op == abi.CORRUPT_OPS["xor"]:
            new = old ^ p.corrupt_mask
        elif p.corrupt_op == abi.CORRUPT_OPS["set"]:
            new = p.corrupt_mask
        else:
            new = 0
        os.pwrite(fd, (new & (2**64 - 1)).to_bytes(8, "little")[:n], p.corrupt_addr)
        return None
    except OSError as e:
        return f"write {p.corrupt_addr:#x}: {e.strerror}"
    finally:
        os.close(fd)


def pending_fetcher(
    pending_fd: int,
    on_outcome: Callable[[Any], None],
    while_held: Callable[[int, int], None] = lambda tid, fault_seq: None,
) -> Callable[[int], Injection | None]:
    """The copilot's fetch: take (and so delete) a stopped thread's pending
    entry. while_held(tid, fault_seq) runs first, with the thread held (the
    engine reads its maps and its Python stack then); a corrupt write's
    outcome goes to on_outcome."""

    def fetch(tid: int) -> Injection | None:
        p = abi.Pending()
        # Keeping the GIL (pyctl/heldcalls.py): the thread is stopped meanwhile.
        if not map_lookup_and_delete_held(pending_fd, C.c_uint32(tid), p):
            return None
        while_held(tid, p.fault_seq)
        if p.action == abi.ACT_CORRUPT:
            # The thread is stopped at the return site: write, then let
            # the copilot resume it with ax unchanged (an "after" no-op).
            err = write_corruption(tid, p)
            on_outcome(CorruptOutcome(p.fault_seq, tid, p.corrupt_addr, err))
            return Injection(
                fault_seq=p.fault_seq,
                regs=tuple(p.regs),
                retval=p.regs[10],
                stall_ns=0,
                deadline_ns=p.deadline_ns,
                action=abi.ACT_FAIL,
                flags=p.flags | abi.F_AFTER,
            )
        return Injection(
            fault_seq=p.fault_seq,
            regs=tuple(p.regs),
            retval=p.retval,
            stall_ns=p.stall_ns,
            deadline_ns=p.deadline_ns,
            action=p.action,
            flags=p.flags,
            # A fail's errno rides in the corrupt mask (FaultSpec.to_bpf).
            errno=p.corrupt_mask if p.action == abi.ACT_FAIL else 0,
        )

    return fetch


def start_copilot(
    pid: int,
    signo: int,
    pending_fd: int,
    on_outcome: Callable[[Outcome | CorruptOutcome], None],
    while_held: Callable[[int, int], None] = lambda tid, fault_seq: None,
) -> Copilot:
    """Seize pid's threads and finish the injections BPF hands over;
    raises CopilotError."""
    copilot = Copilot(pid, signo, pending_fetcher(pending_fd, on_outcome, while_held), on_outcome)
    copilot.start()
    return copilot
