"""The fault engine: resolve -> load -> arm -> attach -> consume -> record.

Everything that can fail on bad input (library, symbol, pid, spec) is
checked before anything is loaded or written, so a refused command leaves
no probe and no row. BPF links live only as file descriptors of this
process: if it dies, the kernel detaches every probe, and faults stop at
their deadline anyway because the deadline is checked in BPF.

Engine is the event loop; each concern is a module of its own:
- mechanism.py: Plan, every decision of how a fault is carried out
  (program pair, return probes, single or multi links, copilot, BPF flags);
  plan() and Attachment, the probe sites;
- links.py: the BPF object loaded, attached, read and detached;
- evidence.py: decoded ring records -> rows (EvidenceWriter);
- pyctl/copilot/injections.py: the copilot's share (pending entries,
  corrupt writes), wired here.
The loop itself lives in this file because tests and benches patch
`pyctl.engine.uprobe_multi` and `pyctl.engine.FIRES_RING_BYTES`, which it
reads when a run starts.
"""

from __future__ import annotations

import ctypes as C
import os
import select
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyctl.bpf import abi, main_object, warmup
from pyctl.bpf.libbpf import BpfError, Object
from pyctl.bpf.ringbuf import RingReader
from pyctl.capabilities import MAIN_OBJ, regs_writable, uprobe_multi, user_writable
from pyctl.engine.errors import EngineError, StoreWriteError
from pyctl.engine.evidence import (
    CALL_REC,
    NOT_INJECTED,
    EvidenceWriter,
    RunStats,
    merge_outcome,
    signal_cause,
)
from pyctl.engine.links import Links
from pyctl.engine.mechanism import Attachment, Plan, needs_return_probe, plan
from pyctl.lazymod import OnFirstUse
from pyctl.paths import DEFAULT_DB
from pyctl.run_options import DEFAULT_MAX_DB_BYTES, RunOptions
from pyctl.spec import FaultSpec, SpecError, check_stack_copy
from pyctl.symbols import resolve
from pyctl.symbols.symbolize import Symbolizer, read_maps

if TYPE_CHECKING:
    import sqlite3

    from pyctl.evidence import store
else:
    # Opened after an early trace's probes are in (pyctl/early.py): not
    # imported before (pyctl/lazymod.py).
    sqlite3 = OnFirstUse("sqlite3")
    store = OnFirstUse("pyctl.evidence.store")

DEFAULT_COPILOT_SIGNAL = main_object.DEFAULT_COPILOT_SIGNAL
# One drain pass: about this long (then the caller sees its deadline and
# signals again), in batches this large: ~10-25 ms of inserts each on the
# 2-core dev VM under load, ~110 ms worst seen (a WAL checkpoint), so a
# pass ends within ~100 ms at any event rate. Larger batches bought no
# throughput there (4,096 vs 16,384 rows: same events/s).
DRAIN_BUDGET_S = 0.04
CALL_BATCH = 4096
FIRE_BATCH = 512

# The fires ring's size: pyctl/bpf/main_object.py says why (tests patch it here).
FIRES_RING_BYTES = main_object.FIRES_RING_BYTES


def __getattr__(name: str) -> Any:
    """The copilot's share, imported when asked for (importing the copilot
    costs ~60 ms that a run without one need not pay)."""
    if name in ("write_corruption", "CorruptOutcome"):
        # lazy: keeps pyctl.copilot.injections (+23 modules, ~200 ms) off trace's start and `--help`
        from pyctl.copilot import injections

        return getattr(injections, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Part:
    """An Engine attribute that is one of its parts': the plan's
    (mechanism.py) or the evidence writer's (evidence.py)."""

    def __init__(self, part: str, name: str = "", *, settable: bool = False) -> None:
        self.part, self.name, self.settable = part, name, settable

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, eng: Engine | None, owner: type | None = None) -> Any:
        return self if eng is None else getattr(getattr(eng, self.part), self.name)

    def __set__(self, eng: Engine, value: Any) -> None:
        if not self.settable:
            raise AttributeError(f"Engine.{self.name} is the {self.part}'s: read only")
        setattr(getattr(eng, self.part), self.name, value)


class Engine:
    """One run: owns the BPF object, the rings, the store and the copilot."""

    def __init__(
        self,
        specs: Sequence[FaultSpec],
        *,
        db_path: str | os.PathLike[str] = DEFAULT_DB,
        pid: int | None = None,
        argv: Sequence[str] = (),
        kind: str = "inject",
        copilot_signal: int = DEFAULT_COPILOT_SIGNAL,
        ring_mib: int = main_object.DEFAULT_RING_BYTES >> 20,
        use_regs: bool | None = None,
        use_user_writes: bool | None = None,
        watch_pids: Sequence[int] = (),
        seize_pid: int | None = None,
        resolve_in_target: bool = True,
        max_db_bytes: int = DEFAULT_MAX_DB_BYTES,
        options: RunOptions | None = None,
        tid: int | None = None,
        stack_copy_bytes: int | None = None,
        use_signal: bool | None = None,
        mechanism: str | None = None,
    ):
        if options is not None:
            # A run's settings in one object (pyctl/run_options.py): the CLI's,
            # through the Runner; the keywords above stay for library use.
            db_path, argv, kind = options.db_path, options.argv, options.kind
            max_db_bytes = options.max_db_bytes
            if options.copilot_signal:
                copilot_signal = options.copilot_signal
            if options.stack_copy_bytes is not None:
                stack_copy_bytes = options.stack_copy_bytes
            mechanism = mechanism or options.mechanism
        self.stack_copy_bytes = (
            main_object.USTACK_BYTES if stack_copy_bytes is None else stack_copy_bytes
        )
        try:
            check_stack_copy(self.stack_copy_bytes, "stack_copy_bytes")
        except SpecError as e:
            raise EngineError(str(e)) from None
        # The run's thread and --duration reach each spec's BPF copy when it
        # is armed (_write_spec), never the specs themselves.
        self.tid = tid or 0
        self.duration = options.duration if options is not None else 0.0
        self.target_labels = dict(options.target_labels) if options is not None else {}
        self.specs = [s.validate() for s in specs]
        self.pid = pid
        self.db_path = db_path
        self.argv = list(argv)
        self.kind = kind
        self.copilot_signal = int(copilot_signal)
        self.ring_bytes = ring_mib << 20
        self.plan = Plan(
            self.specs,
            regs=regs_writable() if use_regs is None else use_regs,
            user_writes=user_writable() if use_user_writes is None else use_user_writes,
        )
        self.links: Links | None = None
        self.watch = list(watch_pids) or ([pid] if pid else [])
        self.seize_pid = seize_pid if seize_pid is not None else pid
        # False for a command we hold before exec: its maps are still ours.
        self.resolve_in_target = resolve_in_target
        self.copilot: Any = None
        # The signal fast path (pyctl/fastpath, issue 26), by trial: "auto"
        # (the default) tries it for the fail-skips and timed stalls of a
        # run against a running process on a kernel without BPF register
        # writes and falls back to the copilot with the reason; "signal"
        # refuses the run instead of falling back; "copilot" never tries.
        # use_signal (True: auto, False: copilot) and GPUFAULT_SIGNAL=0
        # (copilot) are the older spellings. helper: the loaded gfsig,
        # signal_refusal: why the copilot carries the run instead.
        self.mechanism_asked = resolve_mechanism(mechanism, use_signal)
        self.use_signal = self.mechanism_asked != "copilot"
        self.helper_signal = 0  # the helper's signal when it differs from the copilot's
        self.signal_copilot_specs: dict[int, str] = {}  # spec -> why the copilot has it
        self.helper: Any = None
        self.signal_refusal: str | None = None
        self.signal_counters: dict[str, int] = {}
        self.stats = RunStats()
        self.evidence = EvidenceWriter(
            self.specs, db_path=db_path, max_db_bytes=max_db_bytes, stats=self.stats
        )
        self._maps_read_at: dict[int, float] = {}  # tgid -> when the copilot last read
        self._tgid_of: dict[int, int] = {}  # tid -> tgid, for the copilot's maps reads
        self._caller_ranges: dict[int, Any] = {}  # spec -> callers.Range
        self._armed_at = 0
        self._armed_wall: float | None = None  # time.time() at arm()
        self._store_later = False  # start(store_later=True): the store comes second
        self._ep: select.epoll | None = None
        self._fires_ring_bytes = FIRES_RING_BYTES
        self.write_error: str | None = None
        self.end_error: str | None = None
        self.armed = False
        self._armed_cfgs: dict[int, abi.Spec] = {}  # what arm() wrote, per spec
        self._db_created = False
        self.attached = False  # the probes are in: calls reach them
        # Said once the probes are in (the CLI's start lines), or None.
        self.attach_note: str | None = None
        # What the run cannot do until the target loads something (said once).
        self.start_warnings: list[str] = []

    # ---- what the plan, the links and the writer hold -------------------
    mechanism = _Part("plan")  # str: what carries the faults out (the run row's word)
    regs = _Part("plan")
    wu = _Part("plan", "user_writes")
    multi = _Part("plan")  # uprobe_multi links (decided at load, where the kernel has them)

    @property
    def obj(self) -> Object | None:
        return self.links.obj if self.links is not None else None

    # The run's rows are the writer's: the database, the run id, the probe
    # sites, gpufa.ko's device and the callbacks, read and set through here.
    db = _Part("evidence", settable=True)
    run_id = _Part("evidence", settable=True)
    atts = _Part("evidence", settable=True)
    anchor_dev = _Part("evidence", settable=True)
    on_fire = _Part("evidence", settable=True)  # Callable[[dict], None] | None: each fault row
    on_notice = _Part("evidence", settable=True)  # Callable[[str], None]: one-line notices
    capped = _Part("evidence")  # call rows stopped at --max-db-size
    max_db_bytes = _Part("evidence")

    def db_bytes(self) -> int:
        return self.evidence.db_bytes()

    # ---- set-up -------------------------------------------------------
    def start(self, *, store_later: bool = False) -> None:
        """Resolve, load, arm, attach; on any error undo everything and raise.

        store_later (pyctl/early.py: `trace --pid` attaching from the entry,
        before the CLI is imported): the probes go in first and the
        database and the run's rows come with a second start(), once the
        command line is parsed. Only for a run nothing fires in
        (stores_later_ok): its calls wait in the ring meanwhile, and the
        run row says when the probes were armed (its `started`)."""
        if self.attached and self.db is None and self._store_later:
            self._start_store()
            return
        if store_later and not self.stores_later_ok():
            raise EngineError("store_later: only for a run whose specs never fire")
        if os.geteuid() != 0:
            raise EngineError("gpufault needs root (BPF, uprobes, ptrace): run it with sudo")
        if not MAIN_OBJ.exists():
            raise EngineError(f"{MAIN_OBJ} missing: run `make build` first")
        if self.plan.needs_copilot() and self.seize_pid is None:
            raise EngineError(
                "fail/stall on this kernel go through the ptrace copilot, which needs a "
                "target: add --pid PID or -- CMD"
            )
        if any(sp.caller for sp in self.specs) and self.pid is None:
            raise EngineError(
                "--caller compares return addresses of one process: add --pid PID or -- CMD"
            )
        if (why := self.plan.errno_refusal()) is not None:
            raise EngineError(why)
        if any(sp.errno for sp in self.specs) and self.pid is not None and self.resolve_in_target:
            # Where the fails will set errno, found now: a target without
            # glibc's TLS errno is refused before anything is attached.
            # lazy: pyctl.copilot.errno_tls (ELF, ptrace reads) only for --errno
            from pyctl.copilot.errno_tls import ErrnoError, tls_offset

            try:
                tls_offset(self.pid)
            except ErrnoError as e:
                raise EngineError(str(e)) from None
        elif any(sp.errno for sp in self.specs):
            # A command not started yet: read this host's libc now, so the
            # first fail's stop does not wait for it (the same file, by inode).
            # lazy: pyctl.copilot.errno_tls (ELF, ptrace reads) only for --errno
            from pyctl.copilot.errno_tls import ErrnoError, slot_vaddr

            try:
                slot_vaddr(resolve.find_library("libc.so.6").path)
            except (ErrnoError, resolve.ResolveError):
                pass  # told at the fault, in its outcome, if it matters
        if self.plan.needs_copilot() and self.seize_pid is not None:
            # lazy: keeps pyctl.copilot (+22 modules, ~200 ms) off trace's start and `--help`
            from pyctl.copilot import CopilotError, check_not_traced

            try:
                check_not_traced(self.seize_pid)
            except CopilotError as e:
                raise EngineError(str(e)) from None
        for sp in self.specs:
            try:
                sp.check_can_fire(self.duration)
            except SpecError as e:
                raise EngineError(str(e)) from None
        self.atts = self.plan.attachments(self.pid if self.resolve_in_target else None)
        if self.pid is not None and not resolve.pid_alive(self.pid):
            raise EngineError(f"no process {self.pid}: check the pid (is it still running?)")
        if store_later:
            # Nothing can fire (stores_later_ok), so nothing waits for the
            # run row: the probes first. A bad --db is still refused, by the
            # second start(), which detaches them again.
            self._choose_mechanism()
            self._check_not_loaded()
            self._check_init_signals()
            self._store_later = True
            try:
                self._load()
                self.arm()
                self._attach()
            except BaseException:
                self.close(status="refused")
                raise
            return
        # The database is opened and checked (writable, SQLite, gpufault's or
        # new) before anything touches the target: a bad --db must not be
        # found with the signal helper loaded (its trial seizes a thread)
        # or faults armed (tests/test_db_safety.py: no ptrace call before
        # the refusal). A file we create here goes again if the start is
        # refused, so a refused command (--mechanism signal where the trial
        # refuses, too) leaves no database.
        self._open_db()
        try:
            self._choose_mechanism()
            self._check_not_loaded()
            self._check_init_signals()
            self._load()
            if self.plan.needs_copilot():
                self._start_copilot()
            self._write_run_rows()
            self._open_anchors()
            # Snapshot the maps now: a process that crashes on its first fault
            # is gone before its fire record is read. A run that keeps no
            # stack (a trace, --no-stack) names no frame: none of it.
            if self.plan.copies_stacks():
                for p in self.watch:
                    self._watch_maps(p)
                    self.evidence.symbolizers[p] = Symbolizer(p)
            # Nothing may fire before the mechanism that carries it out (the
            # copilot holding every thread) and the run row are ready; and
            # the specs are armed before the probes go in, so the first call
            # that reaches a probe counts (tests/test_first_calls.py: armed
            # after attaching, the calls of the first ms were seen by no one).
            self.arm()
            self._attach()
        except BaseException:
            self.close(status="refused")
            if self._db_created and not self.attached:
                store.remove_db(Path(self.db_path))
            raise

    def stores_later_ok(self) -> bool:
        """start(store_later=True) is allowed: every spec only records (a
        trace), so no fault can fire before the run row exists, and no
        copilot, signal helper or stack copy needs the store at start."""
        return (
            all(sp.action == "observe" for sp in self.specs)
            and not self.plan.needs_copilot()
            and not self._signal_relevant()
            and not self.plan.copies_stacks()
            and not any(sp.caller for sp in self.specs)
        )

    def _open_db(self) -> None:
        try:
            self.db = store.open_db(self.db_path)
        except store.StoreError as e:
            raise EngineError(str(e)) from None
        self._db_created = bool(getattr(self.db, "gf_created", False))

    def _write_run_rows(self, started: float | None = None) -> None:
        """The run row, its specs and probe sites, the target's identity."""
        try:
            self.run_id = store.new_run(
                self.db,
                self.argv,
                self.kind,
                mechanism=self.mechanism,
                capabilities={
                    "regs": self.regs,
                    "copilot_signal": self.copilot_signal,
                    **self._signal_capabilities(),
                },
                started=started,
            )
            self.evidence.write_plan(self.pid, self.tid, self.duration)
            if self.pid:
                # lazy: only a run with a process target reads its identity
                from pyctl.targets import identity

                row = identity.of(self.pid, self.tid or None, self.target_labels)
                self.evidence.write_target(row)
        except sqlite3.Error as e:
            raise EngineError(f"{self.db_path}: {e}") from None

    def _start_store(self) -> None:
        """The second half of a start(store_later=True): the database, the
        run's rows (started: when the specs were armed, before the first
        call the ring holds), gpufa.ko's anchors. Refused here (a bad --db),
        the probes are detached and a database this created is removed, as
        a refused start leaves no file."""
        try:
            self._open_db()
            self._write_run_rows(started=self._armed_wall)
            self._open_anchors()
        except BaseException:
            self.close(status="refused")
            if self._db_created:
                store.remove_db(Path(self.db_path))
            raise

    def _signal_relevant(self) -> bool:
        """The run has fails or stalls that, without the helper, the copilot
        would carry (no BPF register writes on this kernel)."""
        return not self.regs and any(sp.action in ("fail", "stall") for sp in self.specs)

    def _choose_mechanism(self) -> None:
        """The mechanism of the run's fails and stalls (mechanism_asked):
        the signal helper by trial, else the copilot (signal_refusal says
        why). Before anything is loaded or the database opened: a refused
        --mechanism signal leaves nothing behind."""
        if not self._signal_relevant():
            if self.mechanism_asked == "signal":
                why = (
                    "BPF writes the registers on this kernel"
                    if self.regs
                    else self.plan.signal_refusal()
                )
                raise EngineError(f"--mechanism signal: {why} (use --mechanism auto)")
            return
        if self.mechanism_asked == "copilot":
            self.signal_refusal = "the copilot was asked for (--mechanism copilot)"
            return
        self._try_signal(strict=self.mechanism_asked == "signal")

    def _try_signal(self, strict: bool = False) -> None:
        """The signal mechanism by trial: load gfsig into the target and arm
        it for every probe site of the specs it can carry; the others stay
        on the copilot in the same run. Any refusal leaves the run on the
        copilot with the reason in signal_refusal (the run row's
        capabilities) and one start-up warning; strict (--mechanism signal):
        raised instead, with nothing traced or loaded."""
        # lazy: the fast path's loader (ptrace, ELF) only for a run that tries it
        from pyctl.fastpath import FastpathError, SignalTaken, load_for

        self.signal_copilot_specs = {
            i: why
            for i in range(len(self.specs))
            if self.specs[i].action in ("fail", "stall")
            and (why := self.plan.spec_signal_refusal(i)) is not None
        }
        cands: list[int] = []
        command = self.pid is None or not self.resolve_in_target
        for i in [] if command else self.plan.signal_candidates():
            # The helper finds a site by its address in the target: a library
            # the target has not mapped yet has none. The copilot fires it
            # once a dlopen maps it (said once: _check_not_loaded).
            if all(a.lib.mapped for a in self.atts if a.spec == i):
                cands.append(i)
            else:
                self.signal_copilot_specs[i] = "its library is not loaded in the target yet"
        why = None
        if command:
            why = "the signal path loads its helper into a running process: give --pid"
        elif not cands:
            why = self.plan.signal_refusal() or next(iter(self.signal_copilot_specs.values()))
        elif strict and self.signal_copilot_specs:
            why = next(iter(self.signal_copilot_specs.values()))
        tried = False
        if why is None:
            tried = True
            # With specs left on the copilot, the helper needs a signal of
            # its own (the copilot passes it on to the handler).
            self.plan.signal_specs = frozenset(cands)
            mixed = self.plan.needs_copilot()
            self.plan.signal_specs = frozenset()
            durations = [self.specs[i].duration_s or self.duration for i in cands]
            deadline = (
                time.monotonic_ns() + int((max(durations) + 1.0) * 1e9) if all(durations) else 0
            )
            # The copilot's signal first; where the target owns the default
            # SIGURG (a handler, a thread blocking it), SIGWINCH, the other
            # signal that is ignored by default. BPF is loaded after this
            # and sends whichever was armed.
            signos = [self.copilot_signal]
            if self.copilot_signal == DEFAULT_COPILOT_SIGNAL:
                signos.append(int(signal.SIGWINCH))
            if mixed:
                signos = [
                    s for s in (DEFAULT_COPILOT_SIGNAL, signal.SIGWINCH)
                    if int(s) != self.copilot_signal
                ]  # fmt: skip
            for signo in signos:
                try:
                    assert self.pid is not None
                    self.helper = load_for(
                        self.pid, int(signo), self.specs, self.atts, deadline, only=set(cands)
                    )
                    self.plan.signal_specs = frozenset(cands)
                    if mixed:
                        self.helper_signal = int(signo)
                    else:
                        self.copilot_signal = int(signo)
                    return
                except SignalTaken as e:  # the next signal may do
                    why = str(e) if why is None else f"{why}; {e}"
                except FastpathError as e:
                    why = str(e)
                    break
        assert why is not None
        if strict:
            raise EngineError(f"--mechanism signal: {why}")
        self.signal_refusal = why
        if tried:
            # Said once: the target refused the helper (a command started by
            # gpufault, or specs only the copilot does, are no surprise).
            self.start_warnings.append(f"signal fast path not used ({why}): the ptrace copilot")

    def _signal_capabilities(self) -> dict[str, Any]:
        """The run row's word on the signal path: whether the helper carries
        faults, how it was asked for, why not or which specs it left to the
        copilot. Nothing for a run it had no part in (a trace, regs)."""
        if not self._signal_relevant():
            return {}
        caps: dict[str, Any] = {"signal": self.plan.signal, "mechanism": self.mechanism_asked}
        if self.signal_refusal:
            caps["signal_refusal"] = self.signal_refusal
        if self.plan.signal:
            caps["helper_signal"] = self.helper_signal or self.copilot_signal
            left = {str(i): w for i, w in self.signal_copilot_specs.items()}
            if left:
                caps["signal_copilot_specs"] = left
        return caps

    def _unload_helper(self) -> None:
        """After the probes are gone: the helper's counts, then the target's
        own signal action back and the helper unloaded."""
        # lazy: only a run that loaded the helper unloads it
        from pyctl.fastpath import FastpathError

        helper, self.helper = self.helper, None
        self.signal_counters = helper.counters()
        try:
            helper.unload()
        except FastpathError as e:
            self.end_error = f"signal helper left in pid {helper.pid}: {e}"

    def _watch_maps(self, pid: int) -> None:
        """Keep pid's executable mappings current from now on (perf's
        mmap records): its frames keep their modules even when it is
        killed right after its fault. Without perf events (a kernel or a
        sandbox that refuses them), the maps read at attach and refreshed
        while it lives, as before."""
        # lazy: only a run that copies stacks watches mappings (a trace's
        # start-up does not import the perf reader; bench/bench_attach.py)
        from pyctl.symbols.mapwatch import MapWatch, MapWatchError

        try:
            self.evidence.mapwatch[pid] = MapWatch(pid)
        except (MapWatchError, OSError):
            pass

    def _check_not_loaded(self) -> None:
        """Before anything is loaded: a --caller object no process could ever
        map is refused; one, or a --lib, that the target has not mapped yet
        is a warning (start_warnings, said once): a later dlopen makes it
        fire, and until then nothing does."""
        # lazy: keeps pyctl.symbols.callers (+1 module) off trace's start and `--help`
        from pyctl.symbols.callers import CallerError, exec_range, split_site

        in_target = self.pid is not None and self.resolve_in_target
        for lib in dict.fromkeys(a.lib for a in self.atts):
            if in_target and not lib.mapped:
                self.start_warnings.append(
                    f"{lib.display} is not loaded in pid {self.pid} yet: its probes fire "
                    "once the process loads it, nothing fires until then"
                )
        for sp in self.specs:
            obj, _site = split_site(sp.caller)  # a site is checked with its object
            if not sp.caller or obj in ("main", "exe"):
                continue
            if in_target:
                try:
                    if exec_range(self.pid, sp.caller) is not None:  # type: ignore[arg-type]
                        continue
                except CallerError as e:
                    raise EngineError(str(e)) from None
            if not any(c in obj for c in "*?["):
                try:
                    resolve.find_library(obj, self.pid if in_target else None)
                except resolve.ResolveError:
                    where = f"pid {self.pid}'s maps" if in_target else "the program's maps"
                    raise EngineError(
                        f"--caller {sp.caller}: no object of that name in {where} or on the "
                        "library path, so no call can come from it: give main, a loaded "
                        "library's name or a path"
                    ) from None
            if in_target:
                self.start_warnings.append(
                    f"--caller {sp.caller}: not mapped in pid {self.pid} yet: nothing fires "
                    "until it is loaded (a line says when the filter goes live)"
                )

    def _check_init_signals(self) -> None:
        """A signal fault into the init (pid 1) of a PID namespace (a
        container's first process) that has no handler for it: the kernel
        drops such a signal (SIGKILL and SIGSTOP aside), so the fire is
        recorded and nothing happens. Said in one line, once."""
        if self.pid is None:
            return
        sigs = {sp.signo for sp in self.specs if sp.action == "signal" and sp.signo not in (9, 19)}
        if not sigs:
            return
        # lazy: keeps pyctl.targets (+2 modules) off trace's start
        from pyctl.targets import procfs

        nsp = procfs.ns_pids(self.pid)
        if len(nsp) < 2 or nsp[-1] != 1:
            return
        caught = procfs.signal_mask(self.pid, "SigCgt")
        for signo in sorted(sigs):
            if caught is not None and not caught >> (signo - 1) & 1:
                name = _signal_name(signo)
                self.start_warnings.append(
                    f"pid {self.pid} is the init (pid 1) of its PID namespace and has no {name} "
                    "handler: the kernel drops that signal (target another process of it)"
                )

    def arm(self) -> None:
        """Write the specs, before the probes are attached (_attach): the
        first call that reaches a probe counts and may fire. Deadlines and
        windows count from now, the attach's few ms included (a deadline
        never ends later than asked)."""
        assert self.links is not None
        self._armed_at = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        self._armed_wall = time.time()
        self._resolve_callers()
        for i in range(len(self.specs)):
            self._write_spec(i)
        self.armed = True

    def armed_at_s(self) -> float:
        """When arm() ran, on time.monotonic()'s clock (CLOCK_MONOTONIC); 0 before."""
        return self._armed_at / 1e9

    def _write_spec(self, i: int) -> None:
        assert self.links is not None
        rng = self._caller_ranges.get(i)
        cfg = self.plan.bpf_spec(
            i,
            self.atts,
            start_mono_ns=self._armed_at,
            tgid=self.pid or 0,
            tid=self.tid,
            duration_s=self.duration,
            caller=(rng.lo, rng.hi) if rng else None,
            returns_live=self.attached,
        )
        self.links.write_spec(i, cfg)
        self._armed_cfgs[i] = cfg

    def _resolve_callers(self) -> list[int]:
        """Where each --caller object is mapped in the target; the specs
        whose range changed (a library loaded after start)."""
        # lazy: keeps pyctl.symbols.callers (+1 module) off trace's start and `--help`
        from pyctl.symbols.callers import CallerError, exec_range

        changed = []
        for i, sp in enumerate(self.specs):
            if not sp.caller or self.pid is None:
                continue
            try:
                rng = exec_range(self.pid, sp.caller)
            except CallerError as e:
                raise EngineError(str(e)) from None
            if rng != self._caller_ranges.get(i):
                if rng is not None:
                    self._caller_ranges[i] = rng
                    changed.append(i)
        return changed

    def _load(self) -> None:
        self.plan.multi = uprobe_multi()
        self._fires_ring_bytes = FIRES_RING_BYTES
        self.links = Links(
            self.plan,
            ring_bytes=self.ring_bytes,
            fires_ring_bytes=self._fires_ring_bytes,
            copilot_signal=self.copilot_signal,
            ustack_bytes=self.stack_copy_bytes,
            helper_signal=self.helper_signal,
        )
        self.links.load(self.watch)
        self.events = RingReader(self.links.events_fd, self.ring_bytes)
        self.fires = RingReader(self.links.fires_fd, self._fires_ring_bytes)
        self.ustacks = RingReader(self.links.ustacks_fd, self.links.ustacks_ring_bytes)
        self._ep = select.epoll()
        self._ep.register(self.events.fd, select.EPOLLIN)
        self._ep.register(self.fires.fd, select.EPOLLIN)

    def _attach(self) -> None:
        """The probes, last (armed already): from here calls reach them.
        Entry probes first, then return probes (Links.attach); then the
        specs that have return probes say so (F_RETPROBE), the same
        config otherwise: a call is entry-only until then."""
        assert self.links is not None
        try:
            self.links.attach(self.atts, self._attach_pid())
        finally:
            warmup.done()  # the registrations it kept warm are made
        self.attached = True
        for i in range(len(self.specs)):
            if any(a.retprobe for a in self.atts if a.spec == i):
                self._write_spec(i)

    def _attach_pid(self) -> int | None:
        """The pid the kernel filters probes by: the target's, unless its main
        thread has exited (pthread_exit) while others run. The kernel's
        filter goes through the leader's mm, which an exited leader no
        longer has, so a pid filter would never match (a trace said "not
        called" while workers called ~1M/s). Then the probes go on the
        file for every process and BPF keeps the target's calls only (each
        spec's tgid): other processes mapping the library pay the trap, no
        more, and the start says so."""
        if self.pid is None:
            return None
        # lazy: keeps pyctl.procstate (+1 module) off `--help`
        from pyctl import procstate

        live = procstate.live_tid(self.pid)
        if live is None or live == self.pid:
            return self.pid
        libs = sorted({os.path.basename(a.lib.display) for a in self.atts})
        self.attach_note = (
            f"pid {self.pid}'s main thread has exited (its other threads run): the probes "
            f"are on {', '.join(libs)} for every process, and only pid {self.pid}'s calls "
            "count (others that call it pay the probe's cost)"
        )
        return None

    def _start_copilot(self) -> None:
        try:
            # lazy: the ptrace copilot (ctypes, +23 modules) only for a run that needs it
            from pyctl.copilot import CopilotError
            from pyctl.copilot.injections import start_copilot
        except ImportError as e:
            raise EngineError(f"the ptrace copilot is not available here ({e})") from None
        assert self.links is not None and self.seize_pid is not None
        try:
            self.copilot = start_copilot(
                self.seize_pid,
                self.copilot_signal,
                self.links.pending_fd,
                self.evidence.outcomes.put,
                self._maps_while_held,
            )
        except CopilotError as e:
            self.copilot = None
            raise EngineError(str(e)) from None
        # The Python stack is read while a fault's thread is held: find the
        # interpreter (if any) before the first one.
        self.evidence.py_reader(self.seize_pid)

    def _maps_while_held(self, tid: int, fault_seq: int = 0) -> None:
        """On the copilot's thread, with a faulted thread held: its Python
        stack (a CPython target), and, where no perf mmap watch keeps its
        maps current (pyctl/symbols/mapwatch.py: a kernel or sandbox that
        refuses perf events), its maps for the fire's stack (a target that
        exits right after the fault, or a command that exec'd since the
        last read, left the symbolizer with no or stale maps), at most
        every 100 ms per process; the ingest thread takes them up (offer).
        With a watch, /proc/PID/maps is not read here: 1.2 ms of a held
        thread's time per read in a small Python server, more in a torch
        one (issue 26, bench/bench_copilot.py --shape server)."""
        if not self.plan.copies_stacks():
            return  # --no-stack: no stack of either kind, and no wait for one
        tgid = self._tgid_of.get(tid)
        if tgid is None:  # once per thread: this runs at every injected call
            try:
                status = Path(f"/proc/{tid}/status").read_text()
                tgid = self._tgid_of[tid] = int(status.split("\nTgid:", 1)[1].split()[0])
            except (OSError, IndexError, ValueError):
                return
        # A CPython thread's Python stack, while it is still at the fault
        # (pyctl/symbols/pystack.py; ~0.3-0.6 ms, a Python process only).
        self.evidence.held_pystack(tgid, tid, fault_seq)
        sym = self.evidence.symbolizers.get(tgid)
        if sym is None or tgid in self.evidence.mapwatch:
            return  # no stack kept for it, or its maps are current already
        now = time.monotonic()
        if now - self._maps_read_at.get(tgid, 0.0) < 0.1:
            return
        self._maps_read_at[tgid] = now
        maps = read_maps(tgid)
        if maps:
            sym.offer(maps)

    def _open_anchors(self) -> None:
        """With gpufa.ko loaded, tag its anchors with our fault IDs and store
        them; without it, nothing to do (Xids and signals come from BPF)."""
        self.anchor_dev = None
        if not os.path.exists("/dev/gpufa"):
            return
        try:
            # lazy: keeps pyctl.anchors.device (+5 modules) off trace's start
            from pyctl.anchors.device import AnchorDevice

            self.anchor_dev = AnchorDevice(nonblock=True)
        except OSError:
            self.anchor_dev = None

    # ---- the loop -----------------------------------------------------
    def refresh_maps(self) -> None:
        """Keep a recent copy of each watched process's maps for stacks, and
        point --caller filters at objects mapped since the last look."""
        if self.armed and any(sp.caller for sp in self.specs):
            try:
                for i in self._resolve_callers():
                    self._write_spec(i)
                    self.on_notice(
                        f"--caller {self.specs[i].caller}: "
                        f"{self._caller_ranges[i].path} is mapped: filter live"
                    )
            except EngineError:
                pass  # ambiguous now: keep the range we had
        if not self.plan.copies_stacks():
            return
        for p in self.watch:
            sym = self.evidence.symbolizers.get(p)
            if sym is None:
                self.evidence.symbolizers[p] = Symbolizer(p)
            else:
                sym.refresh()

    def poll(self, timeout: float = 0.05, budget_s: float | None = DRAIN_BUDGET_S) -> int:
        """Wait up to timeout for events, then ingest for at most about
        budget_s (plus one batch): the caller's loop sees its deadline and
        signals again within ~100 ms at any event rate."""
        assert self._ep is not None
        self._ep.poll(timeout)
        return self.drain(budget_s)

    def drain(self, budget_s: float | None = None) -> int:
        """Ingest what the rings hold. budget_s: stop after about this long
        (what is left stays in the rings for the next call). None: read what
        is there, but never more than one ring's worth of calls per call, so
        a producer that outruns us cannot keep this from returning.
        Raises StoreWriteError (every fault disarmed) when a write fails."""
        if self.write_error is not None:
            return 0
        end = None if budget_s is None else time.monotonic() + budget_s
        n = 0
        ev = self.evidence
        try:
            # Outcomes the copilot has handed over so far wait for their rows.
            ev.take_outcomes()
            # Fires first, stored raw: a burst leaves the ring at the speed
            # of one INSERT per batch, so the BPF side finds room (a fire
            # without room is skipped). Not held to the budget: one ring's
            # worth at most is a few ms here (bench/bench_fires.py).
            for _ in range(self._fires_ring_bytes // 64 // FIRE_BATCH + 1):
                span, got_n = self.fires.take_span(FIRE_BATCH)
                if got_n:
                    ev.journal_fires(span, got_n)
                n += got_n
                if got_n < FIRE_BATCH:
                    break
            # The stack copies of those fires (each submitted before its
            # fire record): held in memory until their fires become rows.
            for rec in self.ustacks.take(self.ustacks.size // 4096):
                ev.take_ustack(rec)
            most = self.ring_bytes // CALL_REC.size + 1
            got = 0
            while got < most and (end is None or time.monotonic() < end or not got):
                rows = self.events.read_fixed(CALL_REC, CALL_BATCH)
                if not rows:
                    break
                ev.ingest_calls(rows)
                n += len(rows)
                got += len(rows)
            # Then stored fires become rows, in ring order, in what is left
            # of the budget (one batch at least, so a sustained burst still
            # makes progress; all of them without a budget, as at close).
            ev.decode_journal(end)
            ev.drain_anchors()
            ev.take_outcomes()
            ev.update_outcomes()
        except sqlite3.Error as e:
            self.fail_writes(e)
        return n

    def fail_writes(self, e: BaseException) -> None:
        """A write failed (disk full, I/O error): stop every fault at once,
        keep what was committed, and let the caller end the run as failed."""
        self.write_error = f"{self.db_path}: {e}"
        try:
            self.disarm()
        except BpfError:
            pass
        raise StoreWriteError(self.write_error)

    # ---- state --------------------------------------------------------
    def counters(self) -> list[abi.Counters]:
        assert self.links is not None
        return self.links.counters(len(self.specs))

    def lost(self) -> dict[str, int]:
        assert self.links is not None
        return self.links.lost()

    def loss_causes(self) -> dict[str, int]:
        """Why the events ring refused records: runs.stats["events_lost_why"]
        (docs/schema.md), read from the BPF side's diagnosis at each loss."""
        assert self.links is not None
        c = self.links.loss_causes()
        return {
            "ring_full": c["lost_full"],
            "room_when_read": c["lost_room"],
            "backlog_max_bytes": c["lost_backlog_max"],
        }

    def disarm(self) -> None:
        """Stop firing at once (links stay until close)."""
        if self.obj is None:
            return
        assert self.links is not None
        for i in range(len(self.specs)):
            # Clear only the enabled flag: a call that entered while armed
            # returns through the return program, which still needs the
            # spec's action, flags and code (to apply an "after" fault, to
            # record a traced call). Zeroing it lost that call's row.
            cfg = self._armed_cfgs.get(i)
            off = abi.Spec()
            if cfg is not None:
                C.memmove(C.addressof(off), C.addressof(cfg), C.sizeof(off))
                off.flags &= ~abi.F_ENABLED
            self.links.write_spec(i, off)

    def close(self, status: str = "done", exit_code: int | None = None) -> None:
        """Detach everything, finish the copilot, write the run's end. Idempotent."""
        warmup.done()  # a start refused before its attach
        if self.obj is not None:
            try:
                self.disarm()
            except BpfError:
                pass
        if self.copilot is not None:
            try:
                self.copilot.stop()
            finally:
                self.copilot = None
        if self.links is not None and self.obj is not None:
            self.links.detach()
            if self.helper is not None:
                self._unload_helper()
            if self.db is not None and self.run_id:
                try:
                    if self.write_error is None:
                        self.drain()
                        self.evidence.mark_uninjected()
                        self.evidence.mark_unreturned()
                        if self.signal_counters:
                            self.evidence.mark_helper(
                                self.signal_counters, self.helper_signal or self.copilot_signal
                            )
                except Exception:  # noqa: BLE001 - still close the run row
                    pass
                try:
                    cnt = self.counters()
                    self.stats.calls = sum(c.calls for c in cnt)
                    self.stats.lost = self.lost()
                    if n := self.links.ustacks_lost():
                        self.stats.lost["ustacks_lost"] = n
                    if self.stats.lost.get("events_lost"):
                        self.stats.loss_causes = self.loss_causes()
                    # After detach: what is left in flight never returns to us.
                    self.stats.unfinished = self.links.in_flight()
                except Exception:  # noqa: BLE001 - still close the run row
                    pass
            for r in (getattr(self, "events", None), getattr(self, "fires", None),
                      getattr(self, "ustacks", None)):  # fmt: skip
                if r is not None:
                    r.close()
            for mw in self.evidence.mapwatch.values():
                mw.close()
            self.evidence.mapwatch.clear()
            self.evidence.close_pyreaders()
            if self._ep is not None:
                self._ep.close()
                self._ep = None
            self.links.close()
        if self.helper is not None:  # a start refused before the probes went in
            self._unload_helper()
        if self.anchor_dev is not None:
            self.anchor_dev.close()  # also clears the module's fault context
            self.anchor_dev = None
        if self.db is not None and self.run_id:
            if self.write_error is not None and status == "done":
                status = "failed"
            try:
                store.end_run(
                    self.db,
                    self.run_id,
                    status,
                    exit_code,
                    {
                        "calls": self.stats.calls,
                        "fires": self.stats.fires,
                        "events": self.stats.events,
                        "links": self.stats.links,
                        **({"signal": self.signal_counters} if self.signal_counters else {}),
                        "calls_dropped": self.stats.dropped,
                        "calls_unfinished": self.stats.unfinished,
                        **({"write_error": self.write_error} if self.write_error else {}),
                        **self.stats.lost,
                        **(
                            {"events_lost_why": self.stats.loss_causes}
                            if self.stats.loss_causes
                            else {}
                        ),
                    },
                )
            except sqlite3.Error as e:
                # The disk may still be full: the run row keeps "running".
                self.end_error = str(e)
        if self.db is not None:
            try:
                self.db.close()
            except sqlite3.Error:
                pass
            self.db = None


__all__ = [
    "Attachment",
    "CALL_REC",
    "NOT_INJECTED",
    "Engine",
    "EngineError",
    "RunStats",
    "Plan",
    "StoreWriteError",
    "merge_outcome",
    "needs_return_probe",
    "plan",
    "signal_cause",
    "write_corruption",
]


MECHANISMS = ("auto", "signal", "copilot")


def resolve_mechanism(asked: str | None, use_signal: bool | None = None) -> str:
    """The mechanism a run asks for: `asked` (--mechanism, mechanism=),
    else use_signal (True: auto, False: copilot), else auto; an auto run
    with GPUFAULT_SIGNAL=0 in the environment is the copilot's (the switch
    that turns the default off, for a whole test run or service). A bad
    value: EngineError."""
    if asked is None and use_signal is not None:
        asked = "auto" if use_signal else "copilot"
    if asked in (None, "auto"):
        asked = "copilot" if os.environ.get("GPUFAULT_SIGNAL") == "0" else "auto"
    if asked not in MECHANISMS:
        raise EngineError(f"mechanism {asked!r}: give auto, signal or copilot")
    return asked


def _signal_name(signo: int) -> str:
    # lazy: signal (+1 module) only for a signal fault into a namespace's init
    import signal

    try:
        return signal.Signals(signo).name
    except ValueError:
        return f"signal {signo}"
