"""The engine's BPF object (bpf/gpufault.bpf.c), opened and loaded with one
run's settings; and the same load started early, on a thread, by the
`gpufault trace` and `inject` entry (pyctl/entry.py).

Why early: loading is the largest single step between `gpufault trace`
and probes live (libbpf parses the kernel's BTF for the CO-RE reads, then
the verifier runs: ~35-50 ms on the 2-vCPU dev VM), and it depends only on
what the kernel allows, never on the command's arguments, except for the
ring sizes and the copilot's signal, whose defaults it assumes. libbpf runs
without the GIL (ctypes releases it), so the load overlaps the imports of
click and the CLI on another core. The engine takes the early object only
when its own settings equal the ones it was loaded with (take_early); any
other run loads its own, as before, and the early one is closed.

This module stays light (no engine import): the entry imports it before
anything else.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, replace

from pyctl.bpf import abi, warmup
from pyctl.bpf.features import MAIN_OBJ, engine_programs, regs_writable, uprobe_multi, user_writable
from pyctl.bpf.libbpf import BPF_TRACE_UPROBE_MULTI, BpfError, Object
from pyctl.bpf.names import Main

DEFAULT_RING_BYTES = 8 << 20  # the events ring (Engine's ring_mib=8)
DEFAULT_COPILOT_SIGNAL = signal.SIGURG
# The fires ring: a fault fires only when its record fits (else it is
# skipped and counted, bpf/gpufault.bpf.c reserve_fire), so the ring is the
# burst of fires the controller can fall behind by without skipping any.
# A record is 528 bytes with the ring's header: 8 MiB holds 15.8k.
# GPUFAULT_FIRES_RING_BYTES (a power of two, >= 4096) sets it, for tests
# that need a full ring.
FIRES_RING_BYTES = int(os.environ.get("GPUFAULT_FIRES_RING_BYTES", 8 << 20))
# The user stack copied at a fire, for unwinding by call-frame information
# (pyctl/symbols/unwind.py): 16 KiB as perf's --call-graph dwarf default
# (8 KiB) doubled, pages of 4 KiB, at most 32 KiB (bpf/gpufault.h). In its
# own 8 MiB ring: ~500 copies of backlog; one without room is lost, not
# the fire. GPUFAULT_STACK_COPY_BYTES sets it (0: no copy), for benches.
DEFAULT_USTACK_BYTES = 16 << 10
USTACK_BYTES = int(os.environ.get("GPUFAULT_STACK_COPY_BYTES", DEFAULT_USTACK_BYTES))
USTACKS_RING_BYTES = 8 << 20
# A run no spec of which copies a stack at a fire (a `trace`: observe
# never fires) gets the ring at its smallest, one page: creating and
# mapping 8 MiB it will never use was ~3.5 ms of its start-up.
USTACKS_RING_UNUSED = 4096


def ustack_pages(nbytes: int) -> int:
    """Pages the BPF side copies for a stack copy of nbytes (rounded up)."""
    return max(0, min(abi.USTACK_PAGES, -(-nbytes // abi.USTACK_PAGE)))


@dataclass(frozen=True)
class LoadSettings:
    """Everything the loaded object depends on: equal settings, equal object."""

    programs: tuple[str, str]  # the (entry, return) pair to autoload
    multi: bool  # loaded for uprobe_multi links
    ring_bytes: int
    fires_ring_bytes: int
    copilot_signal: int
    ustack_bytes: int = USTACK_BYTES
    ustacks_ring_bytes: int = USTACKS_RING_BYTES
    # The gfsig helper's signal (pyctl/fastpath); 0: the copilot's. Another
    # one only in a run that has both (the copilot passes it on).
    helper_signal: int = 0

    def served_by(self, early: LoadSettings) -> bool:
        """An object loaded with `early` does for these settings: the same,
        or a ustacks ring at least as large (`gpufault serve` preloads the
        inject-sized one, and a served trace takes it)."""
        return early == self or (
            replace(early, ustacks_ring_bytes=self.ustacks_ring_bytes) == self
            and early.ustacks_ring_bytes >= self.ustacks_ring_bytes
        )


def prepare(s: LoadSettings) -> Object:
    """The object opened and set up for s, not loaded yet; raises BpfError."""
    obj = Object(MAIN_OBJ)
    try:
        entry, ret = s.programs
        for p in Main.UPROBE_PROGRAMS:  # autoload only the chosen pair
            obj.set_autoload(p, p in (entry, ret))
        obj.set_max_entries(Main.EVENTS, s.ring_bytes)
        obj.set_max_entries(Main.FIRES, s.fires_ring_bytes)
        obj.set_max_entries(Main.USTACKS, s.ustacks_ring_bytes)
        obj.set_rodata(
            {
                Main.COPILOT_SIGNO: ("=I", s.copilot_signal),
                Main.HELPER_SIGNO: ("=I", s.helper_signal or s.copilot_signal),
                Main.EVENTS_WAKE_BYTES: ("=Q", max(4096, s.ring_bytes // 8)),
                Main.USTACK_PAGES: ("=I", ustack_pages(s.ustack_bytes)),
            }
        )
        if s.multi:
            for prog in (entry, ret):
                obj.set_expected_attach_type(prog, BPF_TRACE_UPROBE_MULTI)
    except BaseException:
        obj.close()
        raise
    return obj


def load(s: LoadSettings) -> Object:
    """Open and load the object; raises BpfError (nothing left open)."""
    obj = prepare(s)
    try:
        obj.load()
    except BaseException:
        obj.close()
        raise
    return obj


def default_settings(command: str = "inject") -> LoadSettings:
    """What a `trace` or `inject` run with default options will ask for
    (a trace's specs never fire, so it copies no stack)."""
    return LoadSettings(
        programs=engine_programs(regs_writable(), user_writable()),
        multi=uprobe_multi(),
        ring_bytes=DEFAULT_RING_BYTES,
        fires_ring_bytes=FIRES_RING_BYTES,
        copilot_signal=int(DEFAULT_COPILOT_SIGNAL),
        ustacks_ring_bytes=USTACKS_RING_UNUSED if command == "trace" else USTACKS_RING_BYTES,
    )


class _Early:
    """The load of one prepared object on a thread. Only the load runs
    there: it is one C call, so the thread needs the GIL once more, at its
    end. Preparing it there too cost ~100 ms on the 2-vCPU VM: each of its
    dozen ctypes calls had to win the GIL back from the importing main
    thread, one switch interval (5 ms) at a time."""

    def __init__(self, settings: LoadSettings, obj: Object) -> None:
        self.settings = settings
        self.obj: Object | None = obj
        self.thread = threading.Thread(target=self._run, name="gf-early-load", daemon=True)

    def _run(self) -> None:
        assert self.obj is not None
        try:
            self.obj.load()
        except (BpfError, OSError):
            # The run's own load says what is wrong, in its words.
            self.obj.close()
            self.obj = None


_early: _Early | None = None


def start_early(command: str = "inject", *, warm: bool = False) -> None:
    """Begin loading with command's default settings (root only: others
    cannot load, and their run ends at its root check); warm: also warm up
    the kernel's uprobe registration for the attach (pyctl/bpf/warmup.py)."""
    global _early
    if _early is not None or os.geteuid() != 0 or os.environ.get("GPUFAULT_NO_EARLY_LOAD"):
        return
    try:
        settings = default_settings(command)
        obj = prepare(settings)
    except (BpfError, OSError):
        return
    _early = _Early(settings, obj)
    _early.thread.start()
    if warm:
        warmup.start(str(MAIN_OBJ))


def take_early(s: LoadSettings) -> Object | None:
    """The early object when it serves settings s (LoadSettings.served_by);
    else None (and the early object, if any, closed). Waits for a load
    still running."""
    global _early
    e, _early = _early, None
    if e is None:
        return None
    e.thread.join()
    if e.obj is not None and s.served_by(e.settings):
        return e.obj
    if e.obj is not None:
        e.obj.close()
    return None


def preload() -> None:
    """Load the default object now, on this thread's behalf, for `gpufault
    serve` (pyctl/resident/server.py): the controller it forks next takes
    it with take_early, and no load thread is running at the fork."""
    start_early()
    if _early is not None:
        _early.thread.join()


def discard_early() -> None:
    """Close this process's early object, if any (the server's copy, once
    a forked controller has its own descriptors for it)."""
    global _early
    e, _early = _early, None
    if e is not None:
        e.thread.join()
        if e.obj is not None:
            e.obj.close()
