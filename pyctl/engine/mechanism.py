"""How a run's faults are carried out, decided in one place.

Which probe sites a run attaches (plan(): specs -> Attachment), which of
them get a return probe, which BPF program pair is loaded (regs or not,
user writes or not), whether the links are uprobe_multi ones, which
faults the ptrace copilot finishes, and the BPF copy each spec is armed
with. The kernel's answers (capabilities: trial loads, never versions)
come in; the decisions go out, and the loader (links.py), the copilot's
wiring and the event loop ask this object instead of deciding again.

(Not named plan.py: `from pyctl.engine import plan` is the function
below, and a submodule of that name would shadow it on the package.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyctl.bpf import abi
from pyctl.capabilities import engine_programs
from pyctl.engine.errors import EngineError
from pyctl.spec import FaultSpec
from pyctl.symbols import resolve


@dataclass
class Attachment:
    func: int  # index into the run's function table (the cookie's low half)
    spec: int
    lib: resolve.Library
    sym: resolve.Symbol
    retprobe: bool
    build_id: str = ""


def needs_return_probe(sp: FaultSpec) -> bool:
    """A uretprobe roughly doubles a probe's cost: attach one only where the
    return matters (trace, fail-after, corrupt). A fail-skip knows its return
    value already; signal and stall act at entry."""
    if sp.trace:
        return not sp.entry_only
    return (sp.action == "fail" and sp.mode == "after") or sp.action == "corrupt"


def plan(specs: Sequence[FaultSpec], pid: int | None) -> list[Attachment]:
    """Resolve every spec to concrete probe sites. Raises on bad input."""
    if pid is not None and not resolve.pid_alive(pid):
        raise EngineError(f"no process {pid}: check the pid (is it still running?)")
    atts: list[Attachment] = []
    seen: dict[tuple[int, int, int, int], int] = {}
    for si, sp in enumerate(specs):
        try:
            lib = resolve.find_library(sp.lib, pid)
            syms = resolve.symbols(lib, sp.fn)
        except resolve.ResolveError as e:
            raise EngineError(str(e)) from None
        for sym in syms:
            key = (lib.dev, lib.inode, sym.offset, si)
            if key in seen:
                continue
            seen[key] = len(atts)
            atts.append(
                Attachment(
                    len(atts), si, lib, sym, needs_return_probe(sp), resolve.build_id(lib.path)
                )
            )
    if len(specs) > abi.MAX_SPECS:
        raise EngineError(f"at most {abi.MAX_SPECS} specs per run")
    return atts


@dataclass
class Plan:
    """Every mechanism decision of one run. regs: uprobe programs may write
    pt_regs (else fail goes through the copilot); user_writes: BPF may
    write user memory (else corrupt goes through the copilot); multi:
    uprobe_multi links (the kernel has them and took the programs as such)."""

    specs: Sequence[FaultSpec]
    regs: bool
    user_writes: bool
    multi: bool = False
    # Specs (indexes) carried out by the gfsig helper loaded into the target
    # (pyctl/fastpath): set by the engine once the helper is armed there.
    # The others stay where they were (the copilot, BPF): one run can have both.
    signal_specs: frozenset[int] = frozenset()

    @property
    def signal(self) -> bool:
        """The helper carries at least one spec."""
        return bool(self.signal_specs)

    @property
    def mechanism(self) -> str:
        """What carries this run's faults out: the ptrace copilot when a spec
        needs it (a stall, a fail without register writes, a corrupt without
        user writes), BPF register writes for a fail ('regs'), the signal
        helper ('signal'; 'signal+copilot' when some specs stay on the
        copilot), else BPF alone ('bpf': a trace, observe, signals,
        BPF-written corruption: no ptrace at all). One word: the run banner
        and the session's armed event carry it; each fault row says its own."""
        if self.needs_copilot():
            return "signal+copilot" if self.signal else "copilot"
        if self.regs and any(s.action == "fail" for s in self.specs):
            return "regs"
        if self.signal:
            return "signal"
        return "bpf"

    def spec_signal_refusal(self, i: int) -> str | None:
        """Why the signal helper cannot carry spec i, or None when it can.
        It does fail-skip and stalls of a given length; a spec it cannot
        carry stays on the copilot in the same run."""
        s = self.specs[i]
        if s.action == "stall" and not s.stall_ms:
            return "a stall with no length (a hang until released) needs the copilot"
        if s.action == "fail" and s.mode == "after":
            return "a fail after the body needs the copilot"
        if s.action not in ("fail", "stall"):
            return f"the signal path does fail and stall, not {s.action}"
        return None

    def signal_candidates(self) -> list[int]:
        """The specs the signal helper would carry: those it can, on a kernel
        without BPF register writes."""
        if self.regs:
            return []
        return [i for i in range(len(self.specs)) if self.spec_signal_refusal(i) is None]

    def signal_refusal(self) -> str | None:
        """Why the signal fast path carries none of this run's faults, or
        None when it can carry some (signal_candidates)."""
        if self.regs:
            return "BPF writes the registers on this kernel"
        if self.signal_candidates():
            return None
        for i, s in enumerate(self.specs):
            if s.action in ("fail", "stall"):
                return self.spec_signal_refusal(i)
        return "no fail or stall to carry out"

    @property
    def programs(self) -> tuple[str, str]:
        """The (entry, return) program pair to load."""
        return engine_programs(self.regs, self.user_writes)

    def copies_stacks(self) -> bool:
        """A spec can fire and keeps its stack (observe never fires: a
        trace copies none, watches no mappings, and its ustacks ring is
        one page)."""
        return any(s.capture_stack and s.action != "observe" for s in self.specs)

    def needs_copilot(self) -> bool:
        return any(
            (s.action == "stall" and i not in self.signal_specs)
            or (s.action == "fail" and not self.regs and i not in self.signal_specs)
            or (s.action == "corrupt" and not self.user_writes)
            for i, s in enumerate(self.specs)
        )

    def errno_refusal(self) -> str | None:
        """Why this run cannot set errno with its fails (--errno), or None.
        errno is thread-local: the copilot writes it in the stopped thread
        (pyctl/copilot/errno_tls.py); a fail that is BPF's register write
        has no stop to do it at."""
        if self.regs and any(s.errno for s in self.specs):
            return (
                "--errno: on this kernel a fail is a BPF register write, which cannot "
                "set the thread's errno (thread-local, only the ptrace copilot writes it): "
                "drop --errno, or run where fails go through the copilot"
            )
        return None

    def single_links(self) -> None:
        """The kernel took the programs as plain uprobes but not as
        uprobe_multi ones (the register-writing pair, say): per-site links."""
        self.multi = False

    def attachments(self, pid: int | None) -> list[Attachment]:
        """plan() for these specs, each site with or without a return probe."""
        atts = plan(self.specs, pid)
        # Regs skip mode must not have a return probe on the same function:
        # the kernel would hijack a return address at the popped stack slot.
        for a in atts:
            sp = self.specs[a.spec]
            if self.regs and sp.action == "fail" and sp.mode == "skip":
                a.retprobe = False
        return atts

    def bpf_spec(
        self,
        i: int,
        atts: Sequence[Attachment],
        *,
        start_mono_ns: int,
        tgid: int,
        tid: int,
        duration_s: float,
        caller: tuple[int, int] | None = None,
        returns_live: bool = True,
    ) -> abi.Spec:
        """Spec i's BPF copy as armed: its mechanism flags (regs or copilot,
        return probe) from this plan; the run's target, --duration and the
        --caller range (None: not mapped yet) where the spec asks for them.
        returns_live: its return probes are attached (F_RETPROBE; the
        engine arms before attaching, bpf/gpufault.bpf.c do_entry)."""
        sp = self.specs[i]
        has_ret = returns_live and any(a.retprobe for a in atts if a.spec == i)
        cfg = sp.to_bpf(start_mono_ns=start_mono_ns, tgid=tgid, tid=tid, duration_s=duration_s)
        if has_ret:
            cfg.flags |= abi.F_RETPROBE
        if sp.action == "fail" and i in self.signal_specs and not self.regs:
            cfg.flags |= abi.F_SIGNAL
        elif sp.action == "fail":
            cfg.flags |= abi.F_REGS if self.regs else abi.F_COPILOT
        elif sp.action == "stall" and i in self.signal_specs:
            cfg.flags |= abi.F_SIGNAL
        elif sp.action == "stall" or (sp.action == "corrupt" and not self.user_writes):
            cfg.flags |= abi.F_COPILOT
        if sp.caller:
            # Not mapped (yet): an empty range matches no call until it is.
            cfg.caller_lo, cfg.caller_hi = caller if caller else (1, 1)
        return cfg
