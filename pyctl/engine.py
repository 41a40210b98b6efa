"""The fault engine: resolve -> load -> arm -> attach -> consume -> record.

Everything that can fail on bad input (library, symbol, pid, spec) is
checked before anything is loaded or written, so a refused command leaves
no probe and no row. BPF links live only as file descriptors of this
process: if it dies, the kernel detaches every probe, and faults stop at
their deadline anyway because the deadline is checked in BPF.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes as C
import json
import os
import queue
import select
import signal as _signal
import sqlite3
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyctl import resolve, store
from pyctl.bpf import abi
from pyctl.bpf.libbpf import (
    BPF_TRACE_UPROBE_MULTI,
    BpfError,
    Object,
    map_count,
    map_lookup,
    map_lookup_and_delete,
    map_update,
)
from pyctl.bpf.ringbuf import RingReader, split_span
from pyctl.capabilities import (
    MAIN_OBJ,
    regs_writable,
    select_programs,
    uprobe_multi,
    user_writable,
)
from pyctl.run_options import DEFAULT_MAX_DB_BYTES, RunOptions
from pyctl.spec import FaultSpec
from pyctl.symbolize import Symbolizer, read_maps

DEFAULT_COPILOT_SIGNAL = _signal.SIGURG
CALL_REC = struct.Struct(abi.CALL_RECORD_FMT)
# Tuple indices of a call record's fields (abi.CALL_IX), named once here
# for the per-batch comprehensions below.
_FAULT_SEQ, _RET, _LAT, _TS = (abi.CALL_IX[k] for k in ("fault_seq", "ret", "latency_ns", "ts_ns"))
_PID, _TID, _KIND, _COOKIE = (abi.CALL_IX[k] for k in ("pid", "tid", "kind", "cookie"))
# One drain pass: about this long (then the caller sees its deadline and
# signals again), in batches this large: ~10-25 ms of inserts each on the
# 2-core dev VM under load, ~110 ms worst seen (a WAL checkpoint), so a
# pass ends within ~100 ms at any event rate. Larger batches bought no
# throughput there (4,096 vs 16,384 rows: same events/s).
DRAIN_BUDGET_S = 0.04
CALL_BATCH = 4096
FIRE_BATCH = 512


@dataclass
class CorruptOutcome:
    fault_seq: int
    tid: int
    addr: int
    error: str | None


# The fires ring: a fault fires only when its record fits (else it is
# skipped and counted, bpf/gpufault.bpf.c reserve_fire), so the ring is the
# burst of fires the controller can fall behind by without skipping any.
# A record is 528 bytes with the ring's header: 8 MiB holds 15.8k. GPUFAULT_FIRES_RING_BYTES (a
# power of two, >= 4096) sets it, for tests that need a full ring.
FIRES_RING_BYTES = int(os.environ.get("GPUFAULT_FIRES_RING_BYTES", 8 << 20))

# Signals a fault can explain in the process it hit: the kernel's own
# reports of a crash (a bad pointer or result used after an error return),
# and SIGABRT (abort() on an error: torch's and NCCL's watchdogs, assert).
CRASH_SIGNALS = frozenset({_signal.SIGSEGV, _signal.SIGBUS, _signal.SIGILL, _signal.SIGFPE,
                           _signal.SIGTRAP, _signal.SIGSYS})


def signal_cause(signo: int, code: int, spec: FaultSpec | None) -> str | None:
    """Why a signal delivered in a faulted process follows from its latest
    fault, or None when it cannot (rule signal-in-faulted-process links only
    these): the signal the fault injected, a crash the kernel reports
    (si_code > 0: the hardware's or kernel's, not a kill() from someone),
    or an abort."""
    if spec is None:
        return None
    if spec.action == "signal" and signo == spec.signo:
        return "injected signal"
    if signo in CRASH_SIGNALS and code > 0:
        return "crash after the fault"
    if signo == _signal.SIGABRT:
        return "abort after the fault"
    return None


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


NOT_INJECTED = (
    "no copilot stop was seen for this fire: the call ran unchanged (the thread "
    "ignored, blocked or never took the hand-off signal, exited, or the copilot was gone)"
)


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



def merge_outcome(merged: dict[str, Any], out: Any) -> None:
    """Fold a copilot or corrupt outcome into a fault's outcome dict, and
    say whether the fault was injected: only when every step that carries
    it out succeeded; a stall happened once the thread was held."""
    if isinstance(out, CorruptOutcome):
        merged.update({"corrupt_addr": out.addr, "corrupt_error": out.error})
    else:
        merged["copilot"] = {
            k: getattr(out, k)
            for k in ("tid", "action", "stop_ns", "resume_ns", "ip_before", "ip_after",
                      "ret_addr", "error")
            if hasattr(out, k)
        }
    cop = merged.get("copilot")
    ok = not merged.get("corrupt_error")
    if isinstance(cop, dict):
        if cop.get("action") == abi.ACT_STALL:
            ok = ok and bool(cop.get("stop_ns"))
        else:
            ok = ok and not cop.get("error")
    merged["injected"] = ok

# A fault row as written at ingest (ret and latency_ns come with its call
# record, now or, when that came first, from what was kept of it; outcome
# from the copilot).
_FAULT_COLS = ("fault_id", "run_id", "seq", "spec", "func", "function", "library", "build_id",
               "action", "mechanism", "retval", "call_seq", "pid", "tid", "comm", "ts_ns",
               "wall", "ret", "latency_ns", "outcome")
_FAULT_SQL = (f"INSERT OR REPLACE INTO faults ({', '.join(_FAULT_COLS)}) "
              f"VALUES ({', '.join('?' * len(_FAULT_COLS))})")


class EngineError(Exception):
    """One-line, user-facing error; nothing is left attached."""


class StoreWriteError(EngineError):
    """Writing the evidence failed mid-run (disk full, I/O error): every
    fault was disarmed at once; the run is to be closed as failed."""


@dataclass
class Attachment:
    func: int  # index into the run's function table (the cookie's low half)
    spec: int
    lib: resolve.Library
    sym: resolve.Symbol
    retprobe: bool
    build_id: str = ""


@dataclass
class RunStats:
    calls: int = 0
    fires: int = 0
    events: int = 0
    links: int = 0
    dropped: int = 0  # call rows not written: the database reached its size cap
    # Calls that entered but whose return came after the probes were gone
    # (in flight at detach): matching, with no call record.
    unfinished: int = 0
    lost: dict[str, int] = field(default_factory=dict)


def _fetch_catalog() -> Any:
    try:
        from pyctl import catalog

        return catalog
    except Exception:  # noqa: BLE001 - the catalog is optional decoration
        return None


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


class Engine:
    """One run: owns the BPF object, the rings, the store and the copilot."""

    def __init__(
        self,
        specs: Sequence[FaultSpec],
        *,
        db_path: str | os.PathLike[str] = store.DEFAULT_DB,
        pid: int | None = None,
        argv: Sequence[str] = (),
        kind: str = "inject",
        copilot_signal: int = DEFAULT_COPILOT_SIGNAL,
        ring_mib: int = 8,
        use_regs: bool | None = None,
        use_user_writes: bool | None = None,
        watch_pids: Sequence[int] = (),
        seize_pid: int | None = None,
        resolve_in_target: bool = True,
        max_db_bytes: int = DEFAULT_MAX_DB_BYTES,
        options: RunOptions | None = None,
        tid: int | None = None,
    ):
        if options is not None:
            # A run's settings in one object (pyctl/run_options.py): the CLI's,
            # through the Runner; the keywords above stay for library use.
            db_path, argv, kind = options.db_path, options.argv, options.kind
            max_db_bytes = options.max_db_bytes
            if options.copilot_signal:
                copilot_signal = options.copilot_signal
        # The run's thread and --duration reach each spec's BPF copy when it
        # is armed (_write_spec), never the specs themselves.
        self.tid = tid or 0
        self.duration = options.duration if options is not None else 0.0
        self.specs = [s.validate() for s in specs]
        self.pid = pid
        self.db_path = db_path
        self.argv = list(argv)
        self.kind = kind
        self.copilot_signal = int(copilot_signal)
        self.ring_bytes = ring_mib << 20
        self.regs = regs_writable() if use_regs is None else use_regs
        self.wu = user_writable() if use_user_writes is None else use_user_writes
        self.multi = False  # uprobe_multi links (set at load, where the kernel has them)
        self.watch = list(watch_pids) or ([pid] if pid else [])
        self.seize_pid = seize_pid if seize_pid is not None else pid
        # False for a command we hold before exec: its maps are still ours.
        self.resolve_in_target = resolve_in_target
        self.obj: Object | None = None
        self.db: Any = None
        self.run_id = ""
        self.atts: list[Attachment] = []
        self.copilot: Any = None
        self.stats = RunStats()
        self._outcomes: queue.Queue[Any] = queue.Queue()
        # Copilot/corrupt outcomes by fault_seq, waiting for their fault row:
        # merged into it as it is written (once), else updated in one batch.
        self._early_outcomes: dict[int, list[Any]] = {}
        # Fires-ring batches stored raw (fire_journal) and not yet turned
        # into rows, oldest first: (batch, records or None once only the
        # database holds them); the fault seqs that have rows; returns that
        # came before their fault's row (seq -> ret, latency).
        self._journal: collections.deque[tuple[int, bytes | None]] = collections.deque()
        self._journal_batch = 0
        self._rowed: set[int] = set()
        self._early_rets: dict[int, tuple[int, int]] = {}
        self._fault_pids: dict[int, list[tuple[str, int, int]]] = {}  # fid, ts, spec
        self._symbolizers: dict[int, Symbolizer] = {}
        self._maps_read_at: dict[int, float] = {}  # tgid -> when the copilot last read
        self._tgid_of: dict[int, int] = {}  # tid -> tgid, for the copilot's maps reads
        self._caller_ranges: dict[int, Any] = {}  # spec -> callers.Range
        self._armed_at = 0
        self._ep: select.epoll | None = None
        self.anchor_dev: Any = None
        self.on_fire: Callable[[dict[str, Any]], None] | None = None
        # One-line notices for the user (the size cap); stderr by default.
        self.on_notice: Callable[[str], None] = lambda m: print(m, file=sys.stderr)
        self.max_db_bytes = max(0, int(max_db_bytes))  # 0: no cap
        self.capped = False
        self.write_error: str | None = None
        self.end_error: str | None = None
        self.armed = False
        self._armed_cfgs: dict[int, abi.Spec] = {}  # what arm() wrote, per spec
        self._db_created = False

    # ---- set-up -------------------------------------------------------
    @property
    def mechanism(self) -> str:
        return "regs" if self.regs else "copilot"

    def _needs_copilot(self) -> bool:
        return any(
            s.action == "stall"
            or (s.action == "fail" and not self.regs)
            or (s.action == "corrupt" and not self.wu)
            for s in self.specs
        )

    def start(self) -> None:
        """Resolve, load, arm, attach; on any error undo everything and raise."""
        if os.geteuid() != 0:
            raise EngineError("gpufault needs root (BPF, uprobes, ptrace): run it with sudo")
        if not MAIN_OBJ.exists():
            raise EngineError(f"{MAIN_OBJ} missing: run `make build` first")
        if self._needs_copilot() and self.seize_pid is None:
            raise EngineError(
                "fail/stall on this kernel go through the ptrace copilot, which needs a "
                "target: add --pid PID or -- CMD"
            )
        if any(sp.caller for sp in self.specs) and self.pid is None:
            raise EngineError("--caller compares return addresses of one process: "
                              "add --pid PID or -- CMD")
        if self._needs_copilot() and self.seize_pid is not None:
            from pyctl.copilot import CopilotError, check_not_traced

            try:
                check_not_traced(self.seize_pid)
            except CopilotError as e:
                raise EngineError(str(e)) from None
        self.atts = plan(self.specs, self.pid if self.resolve_in_target else None)
        if self.pid is not None and not resolve.pid_alive(self.pid):
            raise EngineError(f"no process {self.pid}: check the pid (is it still running?)")
        # Regs skip mode must not have a return probe on the same function:
        # the kernel would hijack a return address at the popped stack slot.
        for a in self.atts:
            sp = self.specs[a.spec]
            if self.regs and sp.action == "fail" and sp.mode == "skip":
                a.retprobe = False
        # The database is opened and checked (writable, SQLite, gpufault's or
        # new) before anything is loaded: a bad --db must not be found with
        # faults already armed. A file we create here goes again if the
        # start is refused, so a refused command leaves no database.
        try:
            self.db = store.open_db(self.db_path)
        except store.StoreError as e:
            raise EngineError(str(e)) from None
        self._db_created = bool(getattr(self.db, "gf_created", False))
        try:
            self._load_and_attach()
            if self._needs_copilot():
                self._start_copilot()
            try:
                self.run_id = store.new_run(
                    self.db,
                    self.argv,
                    self.kind,
                    mechanism=self.mechanism,
                    capabilities={"regs": self.regs, "copilot_signal": self.copilot_signal},
                )
                self._write_plan()
            except sqlite3.Error as e:
                raise EngineError(f"{self.db_path}: {e}") from None
            self._open_anchors()
            # Snapshot the maps now: a process that crashes on its first fault
            # is gone before its fire record is read.
            for p in self.watch:
                self._symbolizers[p] = Symbolizer(p)
            # Last: nothing may fire before the mechanism that carries it out
            # (the copilot holding every thread) and the run row are ready.
            self.arm()
        except BaseException:
            self.close(status="refused")
            if self._db_created and not self.armed:
                store.remove_db(Path(self.db_path))
            raise

    def arm(self) -> None:
        """Write the specs (probes attached with every spec disarmed, so a
        call before this point neither counts nor fires). Deadlines and
        windows count from now."""
        assert self.obj is not None
        self._armed_at = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        self._resolve_callers()
        for i in range(len(self.specs)):
            self._write_spec(i)
        self.armed = True

    def _write_spec(self, i: int) -> None:
        assert self.obj is not None
        sp = self.specs[i]
        has_ret = any(a.retprobe for a in self.atts if a.spec == i)
        cfg = sp.to_bpf(mech_regs=self.regs, retprobe=has_ret, start_mono_ns=self._armed_at,
                        tgid=self.pid or 0, tid=self.tid, duration_s=self.duration)
        if sp.action == "corrupt" and not self.wu:
            cfg.flags |= abi.F_COPILOT
        rng = self._caller_ranges.get(i)
        if sp.caller:
            # Not mapped (yet): an empty range matches no call until it is.
            cfg.caller_lo, cfg.caller_hi = (rng.lo, rng.hi) if rng else (1, 1)
        map_update(self.obj.map_fd("specs"), C.c_uint32(i), cfg)
        self._armed_cfgs[i] = cfg

    def _resolve_callers(self) -> list[int]:
        """Where each --caller object is mapped in the target; the specs
        whose range changed (a library loaded after start)."""
        from pyctl.callers import CallerError, exec_range

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

    def _open_and_load(self, multi: bool) -> tuple[Object, str, str]:
        try:
            obj = Object(MAIN_OBJ)
        except BpfError as e:
            raise EngineError(f"{e}: see `gpufault doctor`") from None
        entry, ret = select_programs(obj, self.regs, self.wu)
        obj.set_max_entries("events", self.ring_bytes)
        obj.set_max_entries("fires", FIRES_RING_BYTES)
        obj.set_rodata(
            {
                "copilot_signo": ("=I", self.copilot_signal),
                "events_wake_bytes": ("=Q", max(4096, self.ring_bytes // 8)),
            }
        )
        if multi:
            for prog in (entry, ret):
                obj.set_expected_attach_type(prog, BPF_TRACE_UPROBE_MULTI)
        try:
            obj.load()
        except BpfError:
            obj.close()
            raise
        return obj, entry, ret

    def _load_and_attach(self) -> None:
        self.multi = uprobe_multi()
        try:
            obj, entry, ret = self._open_and_load(self.multi)
        except BpfError as e:
            if not self.multi:
                raise EngineError(f"{e}: see `gpufault doctor`") from None
            # A kernel may take a program as a plain uprobe but not as a
            # uprobe_multi one (the register-writing pair, say): per-site links.
            self.multi = False
            try:
                obj, entry, ret = self._open_and_load(False)
            except BpfError as e2:
                raise EngineError(f"{e2}: see `gpufault doctor`") from None
        self.obj = obj
        # The specs map stays all zero (every spec disabled) until arm().
        wfd = obj.map_fd("watched")
        for wpid in self.watch:
            map_update(wfd, C.c_uint32(wpid), C.c_uint8(1))
        obj.attach("gf_signal_deliver")
        obj.attach("gf_process_exit")
        attach_pid = self.pid if self.pid is not None else -1
        if self.multi:
            self._attach_multi(obj, entry, ret, attach_pid)
        else:
            for a in self.atts:
                ck = abi.cookie(a.spec, a.func)
                try:
                    obj.attach_uprobe(entry, attach_pid, a.lib.path, a.sym.offset, ck, False)
                    if a.retprobe:
                        obj.attach_uprobe(ret, attach_pid, a.lib.path, a.sym.offset, ck, True)
                except BpfError as e:
                    raise EngineError(f"{e} ({a.sym.name}): see `gpufault doctor`") from None
        self.events = RingReader(obj.map_fd("events"), self.ring_bytes)
        self.fires = RingReader(obj.map_fd("fires"), FIRES_RING_BYTES)
        self._ep = select.epoll()
        self._ep.register(self.events.fd, select.EPOLLIN)
        self._ep.register(self.fires.fd, select.EPOLLIN)

    def _attach_multi(self, obj: Object, entry: str, ret: str, pid: int) -> None:
        """One uprobe_multi link per (file, entry/return), so closing costs
        one kernel wait per link, not per site. A site may appear once per
        link: a function probed by two specs goes into a second link."""
        groups: dict[tuple[str, bool, int], list[Attachment]] = {}
        taken: dict[tuple[str, bool, int], set[int]] = {}
        for a in self.atts:
            for is_ret in (False, True) if a.retprobe else (False,):
                rank = 0
                while a.sym.offset in taken.get((a.lib.path, is_ret, rank), ()):
                    rank += 1
                key = (a.lib.path, is_ret, rank)
                taken.setdefault(key, set()).add(a.sym.offset)
                groups.setdefault(key, []).append(a)
        for (path, is_ret, _), group in groups.items():
            prog = ret if is_ret else entry
            offs = [a.sym.offset for a in group]
            cks = [abi.cookie(a.spec, a.func) for a in group]
            try:
                obj.attach_uprobe_multi(prog, pid, path, offs, cks, is_ret)
            except BpfError as e:
                # Name the site the kernel refused: try them one at a time.
                for a, off, ck in zip(group, offs, cks, strict=True):
                    try:
                        obj.attach_uprobe_multi(prog, pid, path, [off], [ck], is_ret)
                    except BpfError as one:
                        raise EngineError(
                            f"{one} ({a.sym.name}): see `gpufault doctor`") from None
                raise EngineError(f"{e}: see `gpufault doctor`") from None

    def _start_copilot(self) -> None:
        try:
            from pyctl.copilot import Copilot, CopilotError, Injection
        except ImportError as e:
            raise EngineError(f"the ptrace copilot is not available here ({e})") from None
        assert self.obj is not None
        pfd = self.obj.map_fd("pending")

        def fetch(tid: int) -> Any:
            p = abi.Pending()
            if not map_lookup_and_delete(pfd, C.c_uint32(tid), p):
                return None
            self._maps_while_held(tid)
            if p.action == abi.ACT_CORRUPT:
                # The thread is stopped at the return site: write, then let
                # the copilot resume it with ax unchanged (an "after" no-op).
                err = write_corruption(tid, p)
                self._outcomes.put(CorruptOutcome(p.fault_seq, tid, p.corrupt_addr, err))
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
            )

        try:
            assert self.seize_pid is not None
            self.copilot = Copilot(self.seize_pid, self.copilot_signal, fetch, self._outcomes.put)
            self.copilot.start()
        except CopilotError as e:
            self.copilot = None
            raise EngineError(str(e)) from None

    def _maps_while_held(self, tid: int) -> None:
        """On the copilot's thread, with a faulted thread held: its process
        is alive now, so read its maps for the fire's stack (a target that
        exits right after the fault, or a command that exec'd since the
        last read, left the symbolizer with no or stale maps). At most every
        100 ms per process; the ingest thread takes them up (offer)."""
        tgid = self._tgid_of.get(tid)
        if tgid is None:  # once per thread: this runs at every injected call
            try:
                status = Path(f"/proc/{tid}/status").read_text()
                tgid = self._tgid_of[tid] = int(status.split("\nTgid:", 1)[1].split()[0])
            except (OSError, IndexError, ValueError):
                return
        now = time.monotonic()
        if now - self._maps_read_at.get(tgid, 0.0) < 0.1:
            return
        self._maps_read_at[tgid] = now
        sym = self._symbolizers.get(tgid)
        maps = read_maps(tgid)
        if sym is not None and maps:
            sym.offer(maps)

    def _write_plan(self) -> None:
        with self.db.conn:
            self.db["specs"].insert_all(
                {
                    "run_id": self.run_id,
                    "spec": i,
                    "text": s.describe(),
                    # As armed: the run's target and --duration where the spec has none.
                    "json": json.dumps(
                        {**s.to_json(), "tgid": s.tgid or self.pid or 0, "tid": s.tid or self.tid,
                         "duration_s": s.duration_s or self.duration}, default=str),
                }
                for i, s in enumerate(self.specs)
            )
            self.db["funcs"].insert_all(
                {
                    "run_id": self.run_id,
                    "func": a.func,
                    "library": a.lib.display,
                    "build_id": a.build_id,
                    "symbol": a.sym.name,
                    "offset": a.sym.offset,
                    "address": a.sym.address,
                    "first_insn": a.sym.first_insn,
                }
                for a in self.atts
            )

    def _open_anchors(self) -> None:
        """With gpufa.ko loaded, tag its anchors with our fault IDs and store
        them; without it, nothing to do (Xids and signals come from BPF)."""
        self.anchor_dev = None
        if not os.path.exists("/dev/gpufa"):
            return
        try:
            from pyctl.anchors.device import AnchorDevice

            self.anchor_dev = AnchorDevice(nonblock=True)
        except OSError:
            self.anchor_dev = None

    def _drain_anchors(self) -> None:
        if self.anchor_dev is None:
            return
        from pyctl.anchors.store import store_records

        try:
            recs = self.anchor_dev.read()
        except OSError:
            return
        if recs:
            store_records(self.db, recs)

    # ---- the loop -----------------------------------------------------
    def refresh_maps(self) -> None:
        """Keep a recent copy of each watched process's maps for stacks, and
        point --caller filters at objects mapped since the last look."""
        if self.armed and any(sp.caller for sp in self.specs):
            try:
                for i in self._resolve_callers():
                    self._write_spec(i)
                    self.on_notice(f"--caller {self.specs[i].caller}: "
                                 f"{self._caller_ranges[i].path} is mapped: filter live")
            except EngineError:
                pass  # ambiguous now: keep the range we had
        for p in self.watch:
            sym = self._symbolizers.get(p)
            if sym is None:
                self._symbolizers[p] = Symbolizer(p)
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
        try:
            # Outcomes the copilot has handed over so far wait for their rows.
            self._take_outcomes()
            # Fires first, stored raw: a burst leaves the ring at the speed
            # of one INSERT per batch, so the BPF side finds room (a fire
            # without room is skipped). Not held to the budget: one ring's
            # worth at most is a few ms here (bench/bench_fires.py).
            for _ in range(FIRES_RING_BYTES // 64 // FIRE_BATCH + 1):
                span, got_n = self.fires.take_span(FIRE_BATCH)
                if got_n:
                    self._journal_fires(span, got_n)
                n += got_n
                if got_n < FIRE_BATCH:
                    break
            most = self.ring_bytes // CALL_REC.size + 1
            got = 0
            while got < most and (end is None or time.monotonic() < end or not got):
                rows = self.events.read_fixed(CALL_REC, CALL_BATCH)
                if not rows:
                    break
                self._ingest_calls(rows)
                n += len(rows)
                got += len(rows)
            # Then stored fires become rows, in ring order, in what is left
            # of the budget (one batch at least, so a sustained burst still
            # makes progress; all of them without a budget, as at close).
            self._decode_journal(end)
            self._drain_anchors()
            self._take_outcomes()
            self._update_outcomes()
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

    def db_bytes(self) -> int:
        """The database's size on disk now: the file and its WAL."""
        n = 0
        for f in (str(self.db_path), f"{self.db_path}-wal"):
            try:
                n += os.stat(f).st_size
            except OSError:
                pass
        return n

    def _check_cap(self) -> None:
        if self.capped or not self.max_db_bytes or self.db_bytes() < self.max_db_bytes:
            return
        self.capped = True
        self.on_notice(
            f"gpufault: {self.db_path} reached --max-db-size ({_size(self.max_db_bytes)}): "
            "call rows are dropped from now on and counted (faults and links are still "
            "written)"
        )

    def _ingest_calls(self, rows: list[tuple]) -> None:
        """A batch of call records: one transaction, no Python per row except
        for the few that belong to a fault (fault_seq != 0)."""
        rid = self.run_id
        marked = [r for r in rows if r[_FAULT_SEQ]]
        fault_updates = []
        for r in marked:
            if r[_KIND] == abi.EV_FOLLOW:
                continue
            if r[_FAULT_SEQ] in self._rowed:
                fault_updates.append((r[_RET], r[_LAT], store.fault_id(rid, r[_FAULT_SEQ])))
            else:  # its fire is still in the journal: goes into the row
                self._early_rets[r[_FAULT_SEQ]] = (r[_RET], r[_LAT])
        follow = [
            (
                store.fault_id(rid, r[_FAULT_SEQ]),
                rid,
                "error-return",
                "same-thread-next-error",
                r[_TS],
                r[_PID],
                r[_TID],
                json.dumps({"func": r[_COOKIE] & 0xFFFFFFFF, "ret": r[_RET]}),
            )
            for r in marked
            if r[_KIND] == abi.EV_FOLLOW
        ]
        self._check_cap()
        with self.db.conn:
            if self.capped:
                self.stats.dropped += len(rows)
            else:
                store.insert_call_records(self.db, rid, rows)
            if fault_updates:
                self.db.conn.executemany(
                    "UPDATE faults SET ret=?, latency_ns=? WHERE fault_id=?", fault_updates
                )
            if follow:
                self.db.conn.executemany(
                    "INSERT INTO links (fault_id, run_id, kind, rule, ts_ns, pid, tid, detail) "
                    "VALUES (?,?,?,?,?,?,?,?)",
                    follow,
                )
        self.stats.events += len(rows)
        self.stats.links += len(follow)

    @contextlib.contextmanager
    def _tx(self) -> Any:
        """One transaction, re-entrant: a journal batch's rows and the
        batch's deletion commit together (a nested `with conn` would commit
        early)."""
        if self._tx_depth:
            self._tx_depth += 1
            try:
                yield self.db.conn
            finally:
                self._tx_depth -= 1
            return
        self._tx_depth = 1
        try:
            with self.db.conn:
                yield self.db.conn
        finally:
            self._tx_depth = 0

    _tx_depth = 0
    # In-memory copies of stored batches kept for decoding; older ones are
    # read back from the database (a long burst must not grow memory).
    _JOURNAL_MEMORY_BATCHES = 64

    def _journal_fires(self, span: bytes, n: int) -> None:
        """Store one batch of fires-ring records as read (the ring's bytes,
        its 8-byte record headers included: ringbuf.split_span), one row."""
        self._journal_batch += 1
        with self._tx() as c:
            c.execute(
                "INSERT INTO fire_journal (run_id, batch, n, records) VALUES (?, ?, ?, ?)",
                (self.run_id, self._journal_batch, n, span),
            )
        self._journal.append((self._journal_batch, span))
        if len(self._journal) > self._JOURNAL_MEMORY_BATCHES:
            i = len(self._journal) - self._JOURNAL_MEMORY_BATCHES - 1
            self._journal[i] = (self._journal[i][0], None)

    def _decode_journal(self, end: float | None) -> None:
        """Turn stored batches into rows, oldest first, each batch's rows
        and its deletion in one transaction: a fire is in the journal or in
        the tables, never in both or neither."""
        done = 0
        while self._journal and (end is None or not done or time.monotonic() < end):
            batch, span = self._journal[0]
            with self._tx() as c:
                if span is None:
                    (span,) = c.execute(
                        "SELECT records FROM fire_journal WHERE run_id=? AND batch=?",
                        (self.run_id, batch),
                    ).fetchone()
                self._ingest_fires_and_procs(split_span(span))
                c.execute("DELETE FROM fire_journal WHERE run_id=? AND batch=?",
                          (self.run_id, batch))
            self._journal.popleft()
            done += 1

    def _ingest_fires_and_procs(self, recs: list[bytes]) -> None:
        """Records of the fires ring in order: runs of fires go in as one
        batch; a process event (signal, exit) first sees every fire before
        it, since it links to the process's latest fault."""
        fires: list[abi.FireEvent] = []
        for data in recs:
            ev = abi.decode_fires(data)
            if isinstance(ev, abi.ProcEvent):
                self._record_fires(fires)
                fires = []
                self._record_proc(ev)
            else:
                fires.append(ev)
        self._record_fires(fires)

    def _record_fires(self, evs: list[abi.FireEvent]) -> None:
        """A batch of fires: rows built in Python, written in one
        transaction with one executemany per table (a transaction per fire
        capped ingest at ~700 fires/s; a fire whose record finds the ring
        full is skipped, so ingest speed is how long a burst can last)."""
        if not evs:
            return
        faults: list[tuple] = []
        regs_rows: list[tuple] = []
        args_rows: list[tuple] = []
        stack_rows: list[tuple] = []
        rows: list[dict[str, Any]] = []
        cat = _fetch_catalog()
        now_wall = time.time()
        now_mono = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        for ev in evs:
            fid = store.fault_id(self.run_id, ev.fault_seq)
            a = self.atts[ev.cookie & 0xFFFFFFFF]
            sp = self.specs[a.spec]
            regs = dict(zip(abi.REG_NAMES, ev.regs, strict=True))
            raw_args = [regs["di"], regs["si"], regs["dx"], regs["cx"], regs["r8"], regs["r9"]]
            decoded: dict[str, str] = {}
            if cat is not None:
                try:
                    decoded = cat.decode_args(a.sym.name, raw_args) or {}
                except Exception:  # noqa: BLE001 - unknown function: raw args only
                    decoded = {}
            names = list(decoded)
            row = {
                "fault_id": fid,
                "run_id": self.run_id,
                "seq": ev.fault_seq,
                "spec": a.spec,
                "func": a.func,
                "function": a.sym.name,
                "library": a.lib.display,
                "build_id": a.build_id,
                "action": abi.ACTION_NAMES[ev.action],
                "mechanism": abi.MECH_NAMES.get(ev.mech, str(ev.mech)),
                "retval": ev.retval if ev.action == abi.ACT_FAIL else None,
                "call_seq": ev.call_seq,
                "pid": ev.pid,
                "tid": ev.tid,
                "comm": ev.comm.decode(errors="replace"),
                "ts_ns": ev.ts_ns,
                "wall": now_wall - (now_mono - ev.ts_ns) / 1e9,
                "ret": None,
                "latency_ns": None,
                "outcome": None,
            }
            outcome: dict[str, Any] = {"signal": sp.signo} if ev.action == abi.ACT_SIGNAL else {}
            for out in self._early_outcomes.pop(ev.fault_seq, ()):
                merge_outcome(outcome, out)
            row["outcome"] = json.dumps(outcome) if outcome else None
            if (early := self._early_rets.pop(ev.fault_seq, None)) is not None:
                row["ret"], row["latency_ns"] = early
            rows.append(row)
            faults.append(tuple(row[c] for c in _FAULT_COLS))
            regs_rows.extend((fid, k, abi.s64(v)) for k, v in regs.items())
            # Catalogued functions keep only their real arguments.
            nargs = min(len(names) if names else abi.NARGS, abi.NARGS)
            args_rows.extend(
                (fid, i + 1, names[i] if i < len(names) else f"arg{i + 1}", abi.s64(raw_args[i]),
                 decoded[names[i]] if i < len(names) else hex(raw_args[i]))
                for i in range(nargs))
            stack_rows.extend(self._frames(ev, a, fid, regs))
        with self._tx() as c:
            c.executemany(_FAULT_SQL, faults)
            c.executemany("INSERT OR REPLACE INTO registers (fault_id, reg, value) "
                          "VALUES (?, ?, ?)", regs_rows)
            c.executemany("INSERT OR REPLACE INTO args (fault_id, idx, name, raw, decoded) "
                          "VALUES (?, ?, ?, ?, ?)", args_rows)
            if stack_rows:
                c.executemany("INSERT OR REPLACE INTO stacks (fault_id, depth, address, "
                              "symbol, module, offset) VALUES (?, ?, ?, ?, ?, ?)", stack_rows)
        for ev, row in zip(evs, rows, strict=True):
            self._rowed.add(ev.fault_seq)
            self._fault_pids.setdefault(ev.pid, []).append(
                (row["fault_id"], ev.ts_ns, row["spec"]))
            self.stats.fires += 1
        if self.anchor_dev is not None:
            # Anchors that fire from now on (a reset, the device falling off
            # the bus) carry the newest fault's ID; set when the fire is
            # read, so milliseconds after the injected call.
            try:
                self.anchor_dev.set_context(rows[-1]["fault_id"], evs[-1].pid)
            except OSError:
                pass
        if self.on_fire:
            for row in rows:
                self.on_fire(row)

    def _frames(self, ev: abi.FireEvent, a: Attachment, fid: str,
                regs: dict[str, int]) -> list[tuple]:
        """The fire's user stack as rows. At the entry the frame pointer walk
        starts at the caller's frame and so skips the caller itself: [sp]
        (ev.caller) goes in as frame 1."""
        sym = self._symbolizers.get(ev.pid)
        if sym is None:
            sym = self._symbolizers[ev.pid] = Symbolizer(ev.pid)
        # The probe site's address gives the library's load base for free.
        probe_vaddr = a.sym.address + (4 if a.sym.skipped_endbr else 0)
        if ev.action != abi.ACT_FAIL or not (ev.flags & abi.F_AFTER):
            sym.learn_base(a.lib.path, regs["ip"] - probe_vaddr)
        if ev.stack_bytes <= 0:
            return []
        addrs = [x for x in ev.stack[: min(ev.stack_bytes // 8, abi.MAX_STACK)]]
        if ev.caller and addrs and (len(addrs) < 2 or addrs[1] != ev.caller):
            addrs.insert(1, ev.caller)
        out = []
        for depth, addr in enumerate(addrs):
            if not addr:
                continue
            name, loc = sym.frame(addr)
            out.append((fid, depth, abi.s64(addr), name,
                        loc[0] if loc else None, loc[1] if loc else None))
        return out

    def _record_proc(self, ev: abi.ProcEvent) -> None:
        faults = self._fault_pids.get(ev.pid)
        fid = faults[-1][0] if faults else None
        if ev.kind == abi.PROC_SIGNAL:
            kind, rule = "signal", "signal-in-faulted-process"
            detail: dict[str, Any] = {"signal": ev.signo, "code": ev.code}
            cause = signal_cause(ev.signo, ev.code, self.specs[faults[-1][2]] if faults else None)
            if cause is None:
                # SIGCHLD from a child, SIGWINCH, a timer: not the fault's doing.
                fid = None
                detail["why"] = "this signal cannot follow from a fault"
            else:
                detail["cause"] = cause
        else:
            kind, rule = "exit", "exit-of-faulted-process"
            status = ev.code
            detail = {
                "exit_status": status >> 8 & 0xFF,
                "term_signal": status & 0x7F,
                "core": bool(status & 0x80),
            }
        if fid is None:
            rule = "unattributed"
        with self._tx():
            self.db["links"].insert(
                {
                    "fault_id": fid,
                    "run_id": self.run_id,
                    "kind": kind,
                    "rule": rule,
                    "ts_ns": ev.ts_ns,
                    "pid": ev.pid,
                    "tid": ev.tid,
                    "detail": json.dumps(detail),
                }
            )
        self.stats.links += 1

    def _take_outcomes(self) -> None:
        while True:
            try:
                out = self._outcomes.get_nowait()
            except queue.Empty:
                return
            self._early_outcomes.setdefault(out.fault_seq, []).append(out)

    def _update_outcomes(self) -> None:
        """Outcomes whose fault row is written already: one transaction.
        The others' fire records are still in the ring (every fire is
        recorded: a fire without room for its record does not happen), so
        they wait for the next drain."""
        if not self._early_outcomes:
            return
        c = self.db.conn
        with c:
            for seq in [q for q in self._early_outcomes if q in self._rowed]:
                fid = store.fault_id(self.run_id, seq)
                row = c.execute("SELECT outcome FROM faults WHERE fault_id=?", (fid,)).fetchone()
                if row is None:
                    continue
                merged = json.loads(row[0]) if row[0] else {}
                for out in self._early_outcomes.pop(seq):
                    merge_outcome(merged, out)
                c.execute("UPDATE faults SET outcome=? WHERE fault_id=?",
                          (json.dumps(merged), fid))

    # ---- state --------------------------------------------------------
    def counters(self) -> list[abi.Counters]:
        assert self.obj is not None
        fd = self.obj.map_fd("counters")
        out = []
        for i in range(len(self.specs)):
            c = abi.Counters()
            map_lookup(fd, C.c_uint32(i), c)
            out.append(c)
        return out

    def lost(self) -> dict[str, int]:
        assert self.obj is not None
        fd = self.obj.map_fd("stats")
        out = {}
        for i, name in enumerate(abi.STAT_NAMES):
            v = C.c_uint64()
            map_lookup(fd, C.c_uint32(i), v)
            out[name] = v.value
        return out

    def _mark_uninjected(self) -> None:
        """Copilot fires with no copilot stop (BPF fired, the thread never
        stopped for us) did not happen: say so, never leave them looking
        injected. Their ret is BPF's intended value, not an observed one."""
        rows = self.db.conn.execute(
            "SELECT fault_id, outcome FROM faults WHERE run_id=? AND mechanism='copilot'",
            (self.run_id,),
        ).fetchall()
        upd = []
        for fid, outcome in rows:
            o = json.loads(outcome) if outcome else {}
            if "copilot" in o:
                continue
            o["injected"] = False
            o["error"] = NOT_INJECTED
            upd.append((json.dumps(o), fid))
        if upd:
            with self.db.conn:
                self.db.conn.executemany(
                    "UPDATE faults SET outcome=?, ret=NULL, latency_ns=NULL WHERE fault_id=?",
                    upd,
                )

    def disarm(self) -> None:
        """Stop firing at once (links stay until close)."""
        if self.obj is None:
            return
        fd = self.obj.map_fd("specs")
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
            map_update(fd, C.c_uint32(i), off)

    def close(self, status: str = "done", exit_code: int | None = None) -> None:
        """Detach everything, finish the copilot, write the run's end. Idempotent."""
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
        if self.obj is not None:
            self.obj.detach_all()
            if self.db is not None and self.run_id:
                try:
                    if self.write_error is None:
                        self.drain()
                        self._mark_uninjected()
                except Exception:  # noqa: BLE001 - still close the run row
                    pass
                try:
                    cnt = self.counters()
                    self.stats.calls = sum(c.calls for c in cnt)
                    self.stats.lost = self.lost()
                    # After detach: what is left in flight never returns to us.
                    self.stats.unfinished = map_count(self.obj.map_fd("inflight"), 16)
                except Exception:  # noqa: BLE001 - still close the run row
                    pass
            for r in (getattr(self, "events", None), getattr(self, "fires", None)):
                if r is not None:
                    r.close()
            if self._ep is not None:
                self._ep.close()
                self._ep = None
            self.obj.close()
            self.obj = None
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
                        "calls_dropped": self.stats.dropped,
                        "calls_unfinished": self.stats.unfinished,
                        **({"write_error": self.write_error} if self.write_error else {}),
                        **self.stats.lost,
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


__all__ = ["Attachment", "Engine", "EngineError", "StoreWriteError", "needs_return_probe", "plan"]
