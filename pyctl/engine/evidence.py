"""The evidence writer: decoded ring records in, the run's rows out.

Call records become calls rows (and error-return links), fires-ring
records become faults, registers, args and stacks rows, process events
(signal, exit) become links, the copilot's outcomes fold into their fault's
outcome. Fires go in two stages (fire_journal): the ring's bytes are stored
raw first, one INSERT a batch, so a burst leaves the ring fast enough for
BPF to find room; then they are decoded into rows, each batch's rows and
its journal row's deletion in one transaction (the re-entrant _tx).

A fault row is written whole, once, when what belongs in it has come by
the time its fire is decoded: in one drain the fires are journaled first,
the calls ring is read next, and the journal is decoded last, so a call
that returned by then (its ret, latency) and the copilot's outcome so far
go into the INSERT. What is still updated, and why:
- ret and latency_ns, when the call returns in a later drain than its
  fire (a stall, a hang, a slow call): the row cannot wait for the return,
  which may never come, and a signal or exit that follows links to it;
- outcome, when the copilot's outcome comes after the row (read, merged,
  written back in one transaction per drain);
- at close, a copilot fire that no copilot stop was seen for is marked not
  injected (mark_uninjected): only the end of the run says it never came.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal as _signal
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyctl import outchan
from pyctl.bpf import abi
from pyctl.bpf.ringbuf import split_span
from pyctl.engine.mechanism import Attachment, needs_return_probe
from pyctl.lazymod import OnFirstUse
from pyctl.paths import DEFAULT_DB
from pyctl.spec import FaultSpec
from pyctl.symbols.demangle import demangle
from pyctl.symbols.symbolize import Symbolizer

if TYPE_CHECKING:
    import json

    from pyctl.evidence import store, words
    from pyctl.symbols import pystack
    from pyctl.symbols.mapwatch import MapWatch
else:
    # The Python-frame reader (~4 ms) is needed only at a fire in a Python
    # process, not on trace's way to its first call (bench/bench_attach.py).
    pystack = OnFirstUse("pyctl.symbols.pystack")
    # The store and its json: used once a run writes, after an early
    # trace's probes are in (pyctl/early.py).
    json = OnFirstUse("json")
    store = OnFirstUse("pyctl.evidence.store")
    words = OnFirstUse("pyctl.evidence.words")

CALL_REC = struct.Struct(abi.CALL_RECORD_FMT)
# Tuple indices of a call record's fields (abi.CALL_IX), named once here
# for the per-batch comprehensions below.
_FAULT_SEQ, _RET, _LAT, _TS = (abi.CALL_IX[k] for k in ("fault_seq", "ret", "latency_ns", "ts_ns"))
_PID, _TID, _KIND, _COOKIE = (abi.CALL_IX[k] for k in ("pid", "tid", "kind", "cookie"))

# Signals a fault can explain in the process it hit: the kernel's own
# reports of a crash (a bad pointer or result used after an error return),
# and SIGABRT (abort() on an error: torch's and NCCL's watchdogs, assert).
CRASH_SIGNALS = frozenset(
    {
        _signal.SIGSEGV,
        _signal.SIGBUS,
        _signal.SIGILL,
        _signal.SIGFPE,
        _signal.SIGTRAP,
        _signal.SIGSYS,
    }
)


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


def merge_outcome(merged: dict[str, Any], out: Any) -> None:
    """Fold a copilot or corrupt outcome into a fault's outcome dict, and
    say whether the fault was injected: only when every step that carries
    it out succeeded; a stall happened once the thread was held."""
    # lazy: loaded with the copilot (+23 modules, ~200 ms), off trace's start and `--help`
    from pyctl.copilot.injections import CorruptOutcome

    if isinstance(out, CorruptOutcome):
        merged.update({"corrupt_addr": out.addr, "corrupt_error": out.error})
    else:
        merged["copilot"] = {
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
                "errno",
                "errno_addr",
            )
            if hasattr(out, k) and (getattr(out, k) or k not in ("errno", "errno_addr"))
        }
    cop = merged.get("copilot")
    ok = not merged.get("corrupt_error")
    if isinstance(cop, dict):
        if cop.get("action") == abi.ACT_STALL:
            ok = ok and bool(cop.get("stop_ns"))
            if cop.get("stop_ns") and cop.get("resume_ns"):
                # How long the thread was held: the stall's latency (held_latency).
                merged["held_ns"] = cop["resume_ns"] - cop["stop_ns"]
        else:
            ok = ok and not cop.get("error")
        err = cop.get("error") or ""
        if err.startswith("thread exited"):
            # Held (or about to be) when it died: the call never returned.
            merged["returned"] = False
            merged["no_return"] = err
    merged["injected"] = ok


def held_latency(outcome: dict[str, Any], latency_ns: int | None) -> int | None:
    """A fault's latency_ns: the call's own (entry to return) where its
    return was seen, else how long the copilot held the thread (a stall
    has no return probe: the held time is what `show` says it lasted)."""
    if latency_ns is not None:
        return latency_ns
    held = outcome.get("held_ns")
    return int(held) if isinstance(held, int) else None


# A fault row as written at ingest (ret and latency_ns come with its call
# record, now or, when that came first, from what was kept of it; outcome
# from the copilot).
_FAULT_COLS = (
    "fault_id",
    "run_id",
    "seq",
    "spec",
    "func",
    "function",
    "library",
    "build_id",
    "action",
    "mechanism",
    "retval",
    "call_seq",
    "pid",
    "tid",
    "comm",
    "ts_ns",
    "wall",
    "ret",
    "latency_ns",
    "outcome",
)
_FAULT_SQL = (
    f"INSERT OR REPLACE INTO faults ({', '.join(_FAULT_COLS)}) "
    f"VALUES ({', '.join('?' * len(_FAULT_COLS))})"
)


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
    # Why events were lost, when some were (Engine.loss_causes).
    loss_causes: dict[str, int] = field(default_factory=dict)


def _py_outcome(py: pystack.PyStack, fire_ns: int) -> dict[str, Any]:
    """outcome.python: how the frames were read (pyctl/evidence/words.py)."""
    out = {k: v for k, v in py.to_json().items() if k != "frames"}
    out["fire_ns"] = fire_ns
    return out


def _py_rows(fid: str, py: pystack.PyStack) -> list[tuple]:
    return [
        (fid, i, pf.function, pf.file, pf.line, int(pf.entry)) for i, pf in enumerate(py.frames)
    ]


def _fetch_catalog() -> Any:
    try:
        # lazy: the catalog is optional decoration of the evidence (None without it)
        from pyctl import catalog

        return catalog
    except Exception:  # noqa: BLE001 - the catalog is optional decoration
        return None


class EvidenceWriter:
    """One run's rows, from decoded events (no BPF: tests feed it events)."""

    def __init__(
        self,
        specs: Sequence[FaultSpec],
        *,
        db_path: str | os.PathLike[str] = DEFAULT_DB,
        max_db_bytes: int = 0,
        stats: RunStats | None = None,
    ) -> None:
        self.specs = specs
        self.db_path = db_path
        self.db: Any = None  # the run's store.open_db(), set when it opens
        self.run_id = ""
        self.atts: list[Attachment] = []
        self.stats = stats if stats is not None else RunStats()
        # Copilot and corrupt outcomes, put here by the copilot's thread.
        self.outcomes: queue.Queue[Any] = queue.Queue()
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
        self._early_rets: dict[int, tuple[int, int | None]] = {}
        self._fault_pids: dict[int, list[tuple[str, int, int]]] = {}  # fid, ts, spec
        self.symbolizers: dict[int, Symbolizer] = {}  # pid -> its stacks' symbolizer
        # pid -> its executable mappings, kept current from attach on
        # (pyctl/symbols/mapwatch.py); fault_seq -> (base, stack copy) read
        # from the ustacks ring, until the fire becomes rows.
        self.mapwatch: dict[int, MapWatch] = {}
        self.ustacks: dict[int, tuple[int, bytes]] = {}
        # pid -> its CPython reader (pyctl/symbols/pystack.py; not_python
        # where it runs none), and its mappings' interpreter key.
        self.pyreaders: dict[int, pystack.Reader] = {}
        self._held_readers: dict[int, pystack.Reader] = {}  # the copilot thread's
        self._py_keys: dict[int, tuple[object, tuple[tuple[str, int], ...]]] = {}
        # fault seq -> (fault_id, pid, tid, fire ts): copilot fires whose
        # Python stack comes with the copilot's hold (_settle_pystacks).
        self._py_pending: dict[int, tuple[str, int, int, int]] = {}
        # fault seq -> the Python stack the copilot's thread read while it
        # held the fault's thread (held_pystack), until the fire's ingest
        # takes it (bounded: a run's end or a thread gone leaves some).
        self.held_py: dict[int, pystack.PyStack] = {}
        self.anchor_dev: Any = None  # gpufa.ko's device, where loaded (tagged per fault)
        self.on_fire: Callable[[dict[str, Any]], None] | None = None
        self._fired_rows: list[dict[str, Any]] = []  # stored, not yet handed to on_fire
        # One-line notices for the user (the size cap); stderr by default, best
        # effort: the cap's notice is said inside a batch's transaction, and a
        # write that raised there (a closed stderr) rolled the batch back.
        self.on_notice: Callable[[str], None] = outchan.echo
        self.max_db_bytes = max(0, int(max_db_bytes))  # 0: no cap
        self.capped = False

    def write_plan(self, pid: int | None, tid: int, duration: float) -> None:
        """The run's specs as armed (with the run's target and --duration) and
        its probe sites (funcs), at start."""
        with self.db.conn:
            self.db["specs"].insert_all(
                {
                    "run_id": self.run_id,
                    "spec": i,
                    "text": s.describe(),
                    # As armed: the run's target and --duration where the spec has none.
                    "json": json.dumps(
                        {
                            **s.to_json(),
                            "tgid": s.tgid or pid or 0,
                            "tid": s.tid or tid,
                            "duration_s": s.duration_s or duration,
                        },
                        default=str,
                    ),
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
                    # The site's other names; symbol is the one every reader
                    # shows (pyctl/symbols/names.py).
                    "aliases": json.dumps(a.sym.aliases) if a.sym.aliases else None,
                }
                for a in self.atts
            )

    def write_target(self, row: dict[str, Any]) -> None:
        """Who the target process is (pyctl/targets/identity.py), at start."""
        with self.db.conn:
            self.db["targets"].insert({"run_id": self.run_id, **row})

    def drain_anchors(self) -> None:
        if self.anchor_dev is None:
            return
        # lazy: keeps pyctl.evidence.anchors (+6 modules) off trace's start and `--help`
        from pyctl.evidence.anchors import store_records

        try:
            recs = self.anchor_dev.read()
        except OSError:
            return
        if recs:
            store_records(self.db, recs)

    def db_bytes(self) -> int:
        """The database's size on disk now: the file and its WAL."""
        n = 0
        for f in (str(self.db_path), f"{self.db_path}-wal"):
            try:
                n += os.stat(f).st_size
            except OSError:
                pass
        return n

    def check_cap(self) -> None:
        if self.capped or not self.max_db_bytes or self.db_bytes() < self.max_db_bytes:
            return
        self.capped = True
        self.on_notice(
            f"gpufault: {self.db_path} reached --max-db-size ({_size(self.max_db_bytes)}): "
            "call rows are dropped from now on and counted (faults and links are still "
            "written)"
        )

    def ingest_calls(self, rows: list[tuple]) -> None:
        """A batch of call records: one transaction, no Python per row except
        for the few that belong to a fault (fault_seq != 0)."""
        rid = self.run_id
        marked = [r for r in rows if r[_FAULT_SEQ]]
        fault_updates = []
        for r in marked:
            if r[_KIND] == abi.EV_FOLLOW:
                continue
            seen = self._returned(r)
            if seen is None:
                continue
            if r[_FAULT_SEQ] in self._rowed:
                fault_updates.append((*seen, store.fault_id(rid, r[_FAULT_SEQ])))
            else:  # its fire is still in the journal: goes into the row
                self._early_rets[r[_FAULT_SEQ]] = seen
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
        self.check_cap()
        with self.db.conn:
            if self.capped:
                self.stats.dropped += len(rows)
            else:
                store.insert_call_records(self.db, rid, rows)
            if fault_updates:
                # A held time the copilot gave (a stall) stays where no
                # return latency was measured.
                self.db.conn.executemany(
                    "UPDATE faults SET ret=?, latency_ns=coalesce(?, latency_ns) WHERE fault_id=?",
                    fault_updates,
                )
            if follow:
                self.db.conn.executemany(
                    "INSERT INTO links (fault_id, run_id, kind, rule, ts_ns, pid, tid, detail) "
                    "VALUES (?,?,?,?,?,?,?,?)",
                    follow,
                )
        self.stats.events += len(rows)
        self.stats.links += len(follow)

    def _returned(self, r: tuple) -> tuple[int, int | None] | None:
        """(ret, latency_ns) a fault's call record says, or None when it
        says nothing: an entry record (no return probe) carries ret 0 and
        latency 0, which are no observation. Only a fail's entry record
        knows its ret, the injected value (the body never ran); its
        latency was not measured."""
        if r[_KIND] == abi.EV_CALL:
            return r[_RET], r[_LAT]
        spec = r[_COOKIE] >> 32
        if spec < len(self.specs) and self.specs[spec].action == "fail":
            return r[_RET], None
        return None

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

    def journal_fires(self, span: bytes, n: int) -> None:
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

    def decode_journal(self, end: float | None) -> None:
        """Turn stored batches into rows, oldest first, each batch's rows
        and its deletion in one transaction: a fire is in the journal or in
        the tables, never in both or neither."""
        done = 0
        while self._journal and (end is None or not done or time.monotonic() < end):
            batch, span = self._journal[0]
            try:
                with self._tx() as c:
                    if span is None:
                        (span,) = c.execute(
                            "SELECT records FROM fire_journal WHERE run_id=? AND batch=?",
                            (self.run_id, batch),
                        ).fetchone()
                    self._ingest_fires_and_procs(split_span(span))
                    c.execute(
                        "DELETE FROM fire_journal WHERE run_id=? AND batch=?", (self.run_id, batch)
                    )
            except BaseException:
                self._fired_rows.clear()  # rolled back: nothing of it was stored
                raise
            self._journal.popleft()
            done += 1
            self._deliver_fired()

    def _deliver_fired(self) -> None:
        """on_fire for each row of the batch just committed. After the commit,
        never inside the transaction: a callback that raises (a fire line
        written to a closed stderr raised BrokenPipeError there) rolled the
        whole batch back, and the run kept 0 of its faults. A callback's
        error is reported once and costs no evidence."""
        rows, self._fired_rows = self._fired_rows, []
        cb = self.on_fire
        if cb is None:
            return
        for row in rows:
            try:
                cb(row)
            except Exception as e:  # noqa: BLE001 - output never costs evidence
                if not self._callback_failed:
                    self._callback_failed = True
                    try:
                        self.on_notice(
                            f"warning: the fire callback raised {type(e).__name__}: {e}; "
                            "faults are still recorded"
                        )
                    except Exception:  # noqa: BLE001 - the notice is output too
                        pass

    _callback_failed = False

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
        py_rows: list[tuple] = []
        py_left = self._PY_READS_PER_BATCH
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
                # Demangled, as every reader shows it; the symbol as in the
                # file stays in funcs.symbol (docs/symbols.md).
                "function": demangle(a.sym.name),
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
            # The Python stack first: the sooner after the fire, the likelier
            # the thread is still held (a stall) or still in the call.
            py = self.held_py.pop(ev.fault_seq, None)
            if (
                py is None
                and ev.mech == abi.MECH_COPILOT
                and "copilot" not in outcome
                and self._python(ev.pid)
            ):
                # The copilot has not stopped the thread yet: its read while
                # it holds it comes with it (_settle_pystacks), not one now
                # that races the thread.
                self._py_pending[ev.fault_seq] = (fid, ev.pid, ev.tid, ev.ts_ns)
            elif py is None and py_left > 0:
                py = self._pystack(ev.pid, ev.tid)
            if py is not None:
                py_left -= 1
                outcome["python"] = _py_outcome(py, ev.ts_ns)
                py_rows.extend(_py_rows(fid, py))
            for out in self._early_outcomes.pop(ev.fault_seq, ()):
                merge_outcome(outcome, out)
            row["outcome"] = json.dumps(outcome) if outcome else None
            if (early := self._early_rets.pop(ev.fault_seq, None)) is not None:
                row["ret"], row["latency_ns"] = early
            row["latency_ns"] = held_latency(outcome, row["latency_ns"])
            rows.append(row)
            faults.append(tuple(row[c] for c in _FAULT_COLS))
            regs_rows.extend((fid, k, abi.s64(v)) for k, v in regs.items())
            # Catalogued functions keep only their real arguments.
            nargs = min(len(names) if names else abi.NARGS, abi.NARGS)
            args_rows.extend(
                (
                    fid,
                    i + 1,
                    names[i] if i < len(names) else f"arg{i + 1}",
                    abi.s64(raw_args[i]),
                    decoded[names[i]] if i < len(names) else hex(raw_args[i]),
                )
                for i in range(nargs)
            )
            stack_rows.extend(self._frames(ev, a, fid, regs))
        with self._tx() as c:
            c.executemany(_FAULT_SQL, faults)
            c.executemany(
                "INSERT OR REPLACE INTO registers (fault_id, reg, value) VALUES (?, ?, ?)",
                regs_rows,
            )
            c.executemany(
                "INSERT OR REPLACE INTO args (fault_id, idx, name, raw, decoded) "
                "VALUES (?, ?, ?, ?, ?)",
                args_rows,
            )
            if stack_rows:
                c.executemany(
                    "INSERT OR REPLACE INTO stacks (fault_id, depth, address, "
                    "symbol, module, offset, build_id, method, stop) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    stack_rows,
                )
            if py_rows:
                c.executemany(
                    "INSERT OR REPLACE INTO pyframes (fault_id, depth, function, file, line, "
                    "entry) VALUES (?, ?, ?, ?, ?, ?)",
                    py_rows,
                )
        for ev, row in zip(evs, rows, strict=True):
            self._rowed.add(ev.fault_seq)
            self._fault_pids.setdefault(ev.pid, []).append((row["fault_id"], ev.ts_ns, row["spec"]))
            self.stats.fires += 1
        if self.anchor_dev is not None:
            # Anchors that fire from now on (a reset, the device falling off
            # the bus) carry the newest fault's ID; set when the fire is
            # read, so milliseconds after the injected call.
            try:
                self.anchor_dev.set_context(rows[-1]["fault_id"], evs[-1].pid)
            except OSError:
                pass
        # Handed to on_fire once the batch's transaction commits (_deliver_fired).
        self._fired_rows.extend(rows)

    # Python stacks read per batch of fires (~0.6 ms each on the 2-core
    # VM): a storm's later fires keep their native stacks only, and ingest
    # keeps its rate.
    _PY_READS_PER_BATCH = 32

    def _python(self, pid: int) -> bool:
        r = self._reader(pid)
        return r is not None and not r.not_python

    def _pystack(self, pid: int, tid: int) -> pystack.PyStack | None:
        """tid's Python stack now; None: no CPython in pid."""
        r = self._reader(pid)
        return None if r is None or r.not_python else r.thread(tid)

    def _reader(self, pid: int) -> pystack.Reader | None:
        """pid's reader, made once per interpreter: again when the mappings
        (the watch's, kept since attach) show another one (an exec)."""
        cur = self.pyreaders.get(pid)
        watch = self.mapwatch.get(pid)
        key = None
        if watch is not None:
            fm = watch.file_maps()  # the same list while the mappings are
            if self._py_keys.get(pid, (None,))[0] is not fm:
                self._py_keys[pid] = (fm, pystack.interpreter_key(
                    (lo, off, path) for lo, _hi, off, path in fm))  # fmt: skip
            key = self._py_keys[pid][1]
        if cur is None or (key is not None and cur.key != key):
            if cur is not None:
                cur.close()
            try:
                cur = pystack.Reader(pid)
            except OSError:
                return None  # gone already, or no /proc/PID/mem for us
            self.pyreaders[pid] = cur
        return cur

    def _settle_pystacks(self, *, force: bool = False) -> None:
        """Copilot fires whose Python stack waits for the copilot: its held
        read once it came; once the copilot is done with the fire without
        one (its outcome is in), or at the end of the run, a read now, which
        show then says came after the thread moved on."""
        rows: list[tuple] = []
        upd: list[tuple[str, str]] = []
        for seq, (fid, pid, tid, ts) in list(self._py_pending.items()):
            py = self.held_py.pop(seq, None)
            if py is None:
                if not force and seq not in self._early_outcomes:
                    continue
                py = self._pystack(pid, tid)
            del self._py_pending[seq]
            if py is not None:
                rows.extend(_py_rows(fid, py))
                upd.append((json.dumps(_py_outcome(py, ts)), fid))
        if not upd:
            return
        with self.db.conn as c:
            c.executemany(
                "INSERT OR REPLACE INTO pyframes (fault_id, depth, function, file, line, "
                "entry) VALUES (?, ?, ?, ?, ?, ?)",
                rows,
            )
            c.executemany(
                "UPDATE faults SET outcome = json_set(coalesce(outcome, '{}'), '$.python', "
                "json(?)) WHERE fault_id = ?",
                upd,
            )

    _HELD_PY_KEPT = 4096

    def held_pystack(self, pid: int, tid: int, fault_seq: int) -> None:
        """On the copilot's thread, with tid stopped at fault fault_seq: its
        Python stack now, for the fire's ingest to take (a fail is let go
        within microseconds, before its fire is ingested). The reader is
        located at the copilot's start (py_reader), not here."""
        # This thread's own readers (the ingest thread's and its map watch
        # are that thread's), made again when the executable changed (a
        # command's exec after the copilot seized its first image).
        r = self._held_readers.get(pid)
        if r is None or r.exe != pystack.exe_id(pid):
            if r is not None:
                r.close()
            try:
                r = self._held_readers[pid] = pystack.Reader(pid)
            except OSError:
                self._held_readers.pop(pid, None)
                return
        st = r.thread(tid) if not r.not_python else None
        if st is not None and fault_seq:
            self.held_py[fault_seq] = st
            while len(self.held_py) > self._HELD_PY_KEPT:
                try:  # the oldest; the ingest thread pops beside us
                    self.held_py.pop(next(iter(self.held_py)), None)
                except (RuntimeError, StopIteration):
                    break

    def py_reader(self, pid: int) -> None:
        """Locate pid's interpreter now (~25 ms the first time per libpython,
        its symbol tables), off the path of the first injected call."""
        if pid not in self._held_readers:
            try:
                self._held_readers[pid] = pystack.Reader(pid)
            except OSError:
                pass

    def close_pyreaders(self) -> None:
        for r in [*self.pyreaders.values(), *self._held_readers.values()]:
            r.close()
        self.pyreaders.clear()
        self._held_readers.clear()

    # Stack copies held for fires not yet rowed: beyond this many (a storm
    # whose rows lag), the oldest are dropped and those fires keep fp stacks.
    _USTACKS_HELD = 2048

    def take_ustack(self, rec: bytes) -> None:
        """One record of the ustacks ring (struct gf_ustack_event)."""
        ev, copy = abi.decode_ustack(rec)
        self.ustacks[ev.fault_seq] = (ev.base, copy)
        while len(self.ustacks) > self._USTACKS_HELD:
            self.ustacks.pop(next(iter(self.ustacks)))

    def _frames(
        self, ev: abi.FireEvent, a: Attachment, fid: str, regs: dict[str, int]
    ) -> list[tuple]:
        """The fire's user stack as rows (pyctl/symbols/frames.py): unwound
        by CFI from its stack copy, else the frame-pointer walk; the last
        row says why the walk stopped."""
        sym = self.symbolizers.get(ev.pid)
        if sym is None:
            sym = self.symbolizers[ev.pid] = Symbolizer(ev.pid)
        # The probe site's address gives the library's load base for free.
        probe_vaddr = a.sym.address + (4 if a.sym.skipped_endbr else 0)
        if ev.action != abi.ACT_FAIL or not (ev.flags & abi.F_AFTER):
            sym.learn_base(a.lib.path, regs["ip"] - probe_vaddr, a.lib.display)
        copy = self.ustacks.pop(ev.fault_seq, None)
        if ev.stack_bytes <= 0 and copy is None:
            return []
        fp = list(ev.stack[: max(0, min(ev.stack_bytes // 8, abi.MAX_STACK))])
        # lazy: the unwinder (frames, unwind, cfi: ~13 ms) only at a fire's stack
        from pyctl.symbols.frames import fire_frames

        frames, stop = fire_frames(regs, fp, ev.caller, copy, sym, self.mapwatch.get(ev.pid))
        return [
            (fid, f.depth, abi.s64(f.address), f.symbol, f.module, f.offset, f.build_id,
             f.method, stop if i == len(frames) - 1 else None)
            for i, f in enumerate(frames)
        ]  # fmt: skip

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

    def take_outcomes(self) -> None:
        while True:
            try:
                out = self.outcomes.get_nowait()
            except queue.Empty:
                return
            self._early_outcomes.setdefault(out.fault_seq, []).append(out)

    def update_outcomes(self) -> None:
        """Outcomes whose fault row is written already: one transaction.
        The others' fire records are still in the ring (every fire is
        recorded: a fire without room for its record does not happen), so
        they wait for the next drain."""
        if self._py_pending:
            self._settle_pystacks()
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
                c.execute(
                    "UPDATE faults SET outcome=?, latency_ns=coalesce(latency_ns, ?) "
                    "WHERE fault_id=?",
                    (json.dumps(merged), held_latency(merged, None), fid),
                )

    def mark_unreturned(self) -> None:
        """At the end of the run: a fault whose call no return was seen for,
        in a process that exited after it, did not return when the return
        would have been seen (a return probe was on) or when the fault's own
        signal killed it. Stored as outcome.returned false with the reason,
        never as a ret: `show` says "did not return". A call without a
        return probe in a process that lived (or died of something else)
        stays "no return seen": nothing says whether it returned."""
        rows = self.db.conn.execute(
            "SELECT f.fault_id, f.spec, f.outcome, l.detail FROM faults f JOIN links l "
            "ON l.run_id = f.run_id AND l.kind = 'exit' AND l.pid = f.pid AND l.ts_ns >= f.ts_ns "
            "WHERE f.run_id = ? AND f.ret IS NULL "
            "ORDER BY f.fault_id",
            (self.run_id,),
        ).fetchall()
        upd = []
        for fid, spec_i, outcome, detail in rows:
            o = json.loads(outcome) if outcome else {}
            if "returned" in o or spec_i is None or spec_i >= len(self.specs):
                continue
            sp = self.specs[spec_i]
            d = json.loads(detail) if detail else {}
            term = int(d.get("term_signal") or 0)
            how = (
                f"killed by {words.signal_name(term)}"
                if term
                else f"exited with status {d.get('exit_status')}"
            )
            if sp.action == "signal" and term and term == sp.signo:
                o["no_return"] = f"the process was {how}, the signal the fault sent"
            elif needs_return_probe(sp):
                o["no_return"] = f"the process {how} before the call returned"
            else:
                continue
            o["returned"] = False
            upd.append((json.dumps(o), fid))
        if upd:
            with self.db.conn:
                self.db.conn.executemany("UPDATE faults SET outcome=? WHERE fault_id=?", upd)

    def mark_helper(self, counts: dict[str, int], signo: int) -> None:
        """Signal-path fires (mechanism 'signal'): the helper's counts for the
        run in each row's outcome.helper (handled: injections it did; inert,
        stray: BPF's signal found it disarmed or past its deadline, or the
        thread at no site, so that call ran; foreign: others' signals, passed
        on). A handler gives no per-fire record, so injected is said only
        where the counts leave no doubt: nothing inert or stray, every
        recorded signal fire handled."""
        rows = self.db.conn.execute(
            "SELECT fault_id, outcome FROM faults WHERE run_id=? AND mechanism='signal'",
            (self.run_id,),
        ).fetchall()
        if not rows:
            return
        helper = {"signal": _signal.Signals(signo).name, **counts}
        sure = not counts.get("inert") and not counts.get("stray")
        sure = sure and counts.get("handled", 0) >= len(rows)
        upd = []
        for fid, outcome in rows:
            o = json.loads(outcome) if outcome else {}
            o["helper"] = helper
            if sure:
                o["injected"] = True
            upd.append((json.dumps(o), fid))
        with self.db.conn:
            self.db.conn.executemany("UPDATE faults SET outcome=? WHERE fault_id=?", upd)

    def mark_uninjected(self) -> None:
        """Copilot fires with no copilot stop (BPF fired, the thread never
        stopped for us) did not happen: say so, never leave them looking
        injected. Their ret is BPF's intended value, not an observed one."""
        if self._py_pending:
            self._settle_pystacks(force=True)
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
