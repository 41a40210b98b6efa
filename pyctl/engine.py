"""The fault engine: resolve -> load -> arm -> attach -> consume -> record.

Everything that can fail on bad input (library, symbol, pid, spec) is
checked before anything is loaded or written, so a refused command leaves
no probe and no row. BPF links live only as file descriptors of this
process: if it dies, the kernel detaches every probe, and faults stop at
their deadline anyway because the deadline is checked in BPF.
"""

from __future__ import annotations

import ctypes as C
import json
import os
import queue
import select
import signal as _signal
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyctl import resolve, store
from pyctl.bpf import abi
from pyctl.bpf.libbpf import (
    BPF_TRACE_UPROBE_MULTI,
    BpfError,
    Object,
    map_lookup,
    map_lookup_and_delete,
    map_update,
)
from pyctl.bpf.ringbuf import RingReader
from pyctl.capabilities import (
    MAIN_OBJ,
    regs_writable,
    select_programs,
    uprobe_multi,
    user_writable,
)
from pyctl.spec import FaultSpec
from pyctl.symbolize import Symbolizer

DEFAULT_COPILOT_SIGNAL = _signal.SIGURG
CALL_REC = struct.Struct(abi.CALL_RECORD_FMT)


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


class EngineError(Exception):
    """One-line, user-facing error; nothing is left attached."""


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
    ):
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
        self._pending_outcomes: list[Any] = []
        self._fault_pids: dict[int, list[tuple[str, int]]] = {}
        self._symbolizers: dict[int, Symbolizer] = {}
        self._ep: select.epoll | None = None
        self.anchor_dev: Any = None
        self.on_fire: Callable[[dict[str, Any]], None] | None = None

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
        try:
            self._load_and_attach()
            if self._needs_copilot():
                self._start_copilot()
        except BaseException:
            self.close(status="refused")
            raise
        # Only now, with everything in place, does the run exist on disk.
        self.db = store.open_db(self.db_path)
        self.run_id = store.new_run(
            self.db,
            self.argv,
            self.kind,
            mechanism=self.mechanism,
            capabilities={"regs": self.regs, "copilot_signal": self.copilot_signal},
        )
        self._write_plan()
        self._open_anchors()
        # Snapshot the maps now: a process that crashes on its first fault
        # is gone before its fire record is read.
        for p in self.watch:
            self._symbolizers[p] = Symbolizer(p)

    def _open_and_load(self, multi: bool) -> tuple[Object, str, str]:
        try:
            obj = Object(MAIN_OBJ)
        except BpfError as e:
            raise EngineError(f"{e}: see `gpufault doctor`") from None
        entry, ret = select_programs(obj, self.regs, self.wu)
        obj.set_max_entries("events", self.ring_bytes)
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
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        fd = obj.map_fd("specs")
        for i, sp in enumerate(self.specs):
            has_ret = any(a.retprobe for a in self.atts if a.spec == i)
            cfg = sp.to_bpf(mech_regs=self.regs, retprobe=has_ret, start_mono_ns=now)
            if sp.action == "corrupt" and not self.wu:
                cfg.flags |= abi.F_COPILOT
            map_update(fd, C.c_uint32(i), cfg)
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
        self.fires = RingReader(obj.map_fd("fires"), 1 << 20)
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

    def _write_plan(self) -> None:
        with self.db.conn:
            self.db["specs"].insert_all(
                {
                    "run_id": self.run_id,
                    "spec": i,
                    "text": s.describe(),
                    "json": json.dumps(s.to_json(), default=str),
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
        """Keep a recent copy of each watched process's maps for stacks."""
        for p in self.watch:
            sym = self._symbolizers.get(p)
            if sym is None:
                self._symbolizers[p] = Symbolizer(p)
            else:
                sym.refresh()

    def poll(self, timeout: float = 0.05) -> int:
        """Wait up to timeout for events, then ingest whatever is there."""
        assert self._ep is not None
        self._ep.poll(timeout)
        return self.drain()

    def drain(self) -> int:
        n = 0
        for rec in self.fires.records():
            self._ingest_fire_or_proc(bytes(rec))
            n += 1
        while True:
            rows = self.events.read_fixed(CALL_REC)
            if not rows:
                break
            self._ingest_calls(rows)
            n += len(rows)
            if len(rows) < 4096:
                break
        self._drain_anchors()
        retry, self._pending_outcomes = self._pending_outcomes, []
        for out in retry:
            self._record_outcome(out)
        while True:
            try:
                self._record_outcome(self._outcomes.get_nowait())
            except queue.Empty:
                break
        return n

    def _ingest_calls(self, rows: list[tuple]) -> None:
        """A batch of call records: one transaction, no Python per row except
        for the few that belong to a fault (r[6] = fault_seq != 0)."""
        rid = self.run_id
        marked = [r for r in rows if r[6]]
        fault_updates = [
            (r[13], r[3], store.fault_id(rid, r[6])) for r in marked if r[16] != abi.EV_FOLLOW
        ]
        follow = [
            (
                store.fault_id(rid, r[6]),
                rid,
                "error-return",
                "same-thread-next-error",
                r[2],
                r[14],
                r[15],
                json.dumps({"func": r[4] & 0xFFFFFFFF, "ret": r[13]}),
            )
            for r in marked
            if r[16] == abi.EV_FOLLOW
        ]
        with self.db.conn:
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

    def _ingest_fire_or_proc(self, data: bytes) -> None:
        if len(data) >= 8 and struct.unpack_from("=Q", data)[0] == abi.PROC_MAGIC:
            self._record_proc(abi.ProcEvent.from_buffer_copy(data[: C.sizeof(abi.ProcEvent)]))
            return
        self._record_fire(abi.FireEvent.from_buffer_copy(data[: C.sizeof(abi.FireEvent)]))

    def _record_fire(self, ev: abi.FireEvent) -> None:
        fid = store.fault_id(self.run_id, ev.fault_seq)
        a = self.atts[ev.cookie & 0xFFFFFFFF]
        sp = self.specs[a.spec]
        regs = dict(zip(abi.REG_NAMES, ev.regs, strict=True))
        raw_args = [regs["di"], regs["si"], regs["dx"], regs["cx"], regs["r8"], regs["r9"]]
        cat = _fetch_catalog()
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
            "wall": time.time() - (time.clock_gettime_ns(time.CLOCK_MONOTONIC) - ev.ts_ns) / 1e9,
            "outcome": None,
        }
        if ev.action == abi.ACT_SIGNAL:
            row["outcome"] = json.dumps({"signal": sp.signo})
        sym = self._symbolizers.get(ev.pid)
        if sym is None:
            sym = self._symbolizers[ev.pid] = Symbolizer(ev.pid)
        # The probe site's address gives the library's load base for free.
        probe_vaddr = a.sym.address + (4 if a.sym.skipped_endbr else 0)
        if ev.action != abi.ACT_FAIL or not (ev.flags & abi.F_AFTER):
            sym.learn_base(a.lib.path, regs["ip"] - probe_vaddr)
        frames = []
        if ev.stack_bytes > 0:
            for i in range(min(ev.stack_bytes // 8, abi.MAX_STACK)):
                addr = ev.stack[i]
                if addr:
                    loc = sym.locate(addr)
                    frames.append(
                        {
                            "fault_id": fid,
                            "depth": i,
                            "address": abi.s64(addr),
                            "symbol": sym.symbolize(addr, parse=False),
                            "module": loc[0] if loc else None,
                            "offset": loc[1] if loc else None,
                        }
                    )
        with self.db.conn:
            self.db["faults"].insert(row, replace=True)
            self.db["registers"].insert_all(
                ({"fault_id": fid, "reg": k, "value": abi.s64(v)} for k, v in regs.items()),
                replace=True,
            )
            # Catalogued functions keep only their real arguments.
            nargs = len(names) if names else abi.NARGS
            self.db["args"].insert_all(
                (
                    {
                        "fault_id": fid,
                        "idx": i + 1,
                        "name": names[i] if i < len(names) else f"arg{i + 1}",
                        "raw": abi.s64(raw_args[i]),
                        "decoded": decoded[names[i]] if i < len(names) else hex(raw_args[i]),
                    }
                    for i in range(min(nargs, abi.NARGS))
                ),
                replace=True,
            )
            if frames:
                self.db["stacks"].insert_all(frames, replace=True, alter=True)
        self._fault_pids.setdefault(ev.pid, []).append((fid, ev.ts_ns))
        if self.anchor_dev is not None:
            # Anchors that fire from now on (a reset, the device falling off
            # the bus) carry this fault's ID; set when the fire is read, so
            # milliseconds after the injected call.
            try:
                self.anchor_dev.set_context(fid, ev.pid)
            except OSError:
                pass
        self.stats.fires += 1
        if self.on_fire:
            self.on_fire(row)

    def _record_proc(self, ev: abi.ProcEvent) -> None:
        faults = self._fault_pids.get(ev.pid)
        fid = faults[-1][0] if faults else None
        if ev.kind == abi.PROC_SIGNAL:
            kind, rule = "signal", "signal-in-faulted-process"
            detail = {"signal": ev.signo, "code": ev.code}
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
        with self.db.conn:
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

    def _record_outcome(self, out: Any) -> None:
        """Merge a copilot/corrupt outcome into its fault row's outcome JSON."""
        fid = store.fault_id(self.run_id, out.fault_seq)
        if isinstance(out, CorruptOutcome):
            patch: dict[str, Any] = {"corrupt_addr": out.addr, "corrupt_error": out.error}
        else:
            patch = {
                "copilot": {
                    k: getattr(out, k)
                    for k in (
                        "tid",
                        "action",
                        "stop_ns",
                        "resume_ns",
                        "ip_before",
                        "ip_after",
                        "ret_addr",
                        "error",
                    )
                    if hasattr(out, k)
                }
            }
        row = self.db.conn.execute("SELECT outcome FROM faults WHERE fault_id=?", (fid,)).fetchone()
        if row is None:
            # The fire record is still in the ring: retry on the next drain.
            tries = getattr(out, "_gf_tries", 0)
            if tries < 50:
                try:
                    object.__setattr__(out, "_gf_tries", tries + 1)
                    self._pending_outcomes.append(out)
                except (AttributeError, TypeError):
                    pass
            return
        merged = json.loads(row[0]) if row[0] else {}
        merged.update(patch)
        with self.db.conn:
            self.db.conn.execute(
                "UPDATE faults SET outcome=? WHERE fault_id=?", (json.dumps(merged), fid)
            )

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

    def disarm(self) -> None:
        """Stop firing at once (links stay until close)."""
        if self.obj is None:
            return
        fd = self.obj.map_fd("specs")
        for i in range(len(self.specs)):
            map_update(fd, C.c_uint32(i), abi.Spec())

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
            if self.db is not None:
                try:
                    self.drain()
                    cnt = self.counters()
                    self.stats.calls = sum(c.calls for c in cnt)
                    self.stats.lost = self.lost()
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
                    **self.stats.lost,
                },
            )
            self.db.close()
            self.db = None


__all__ = ["Attachment", "Engine", "EngineError", "needs_return_probe", "plan"]
