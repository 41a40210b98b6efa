"""The event -> row -> `show` path without root: synthetic decoded ring
records (fires, process events, call records, copilot outcomes) into the
evidence writer (pyctl/engine/evidence.py) over a temporary database, the
rows and `gpufault show`'s text (pyctl.evidence.query) out. The probe site is this
process's own libc getpid, so stacks and the load base are real."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sqlite3
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pyctl.bpf import abi
from pyctl.bpf.ringbuf import HDR
from pyctl.copilot import Outcome
from pyctl.copilot.injections import CorruptOutcome
from pyctl.engine import NOT_INJECTED, Attachment
from pyctl.engine.evidence import CALL_REC, EvidenceWriter
from pyctl.evidence import query, store
from pyctl.spec import FaultSpec
from pyctl.symbols import pystack, resolve

PID = os.getpid()
TID = threading.get_native_id()
LIBC = resolve.find_library("libc", PID)
GETPID = resolve.symbols(LIBC, "getpid")[0]
# Where getpid is in this process: frame #0 of every synthetic fire.
GETPID_ADDR = ctypes.cast(ctypes.CDLL(LIBC.path).getpid, ctypes.c_void_p).value or 0


class _NoPython(pystack.Reader):
    def __init__(self, pid: int) -> None:  # no interpreter looked for
        self.pid, self.not_python, self.key, self.error = pid, True, (), ""

    def close(self) -> None:
        pass


class Run:
    """A writer over a fresh database with one spec and one probe site."""

    def __init__(self, path: Path, spec: FaultSpec, **kw: object) -> None:
        self.path = path
        self.db = store.open_db(path)
        self.spec = spec.validate()
        self.w = EvidenceWriter([self.spec], db_path=path, **kw)  # type: ignore[arg-type]
        self.w.db = self.db
        self.w.run_id = store.new_run(self.db, ["test"], "inject", mechanism="copilot")
        self.w.atts = [Attachment(0, 0, LIBC, GETPID, True, resolve.build_id(LIBC.path))]
        self.w.write_plan(PID, 0, 0.0)
        # The fires name this test process, a CPython: its Python frames
        # (tests/test_pystack.py) are not what these tests count.
        self.w.pyreaders[PID] = _NoPython(PID)
        self.fired: list[dict] = []
        self.w.on_fire = self.fired.append

    def fid(self, seq: int) -> str:
        return store.fault_id(self.w.run_id, seq)

    def rows(self, sql: str, *args: object) -> list[tuple]:
        return self.db.conn.execute(sql, args).fetchall()

    def show(self, seq: int) -> str:
        doc = query.fault_chain(self.db, self.fid(seq))
        assert doc is not None
        return query.render_chain(doc)


@pytest.fixture
def fail_run(tmp_path: Path) -> Iterator[Run]:
    r = Run(tmp_path / "x.db", FaultSpec(lib="libc", fn="getpid", action="fail", ret=-5))
    yield r
    r.db.close()


def fire(
    seq: int, *, action: int = abi.ACT_FAIL, mech: int = 2, retval: int = -5, flags: int = 0
) -> bytes:
    """A fires-ring record as BPF writes it (struct gf_fire_event)."""
    ev = abi.FireEvent()
    ev.hdr.kind, ev.hdr.size = abi.REC_FIRE, ctypes.sizeof(abi.FireEvent)
    ev.fault_seq, ev.ts_ns = seq, time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    ev.cookie, ev.call_seq = abi.cookie(0, 0), 3
    ev.pid, ev.tid, ev.action, ev.mech, ev.retval, ev.flags = PID, TID, action, mech, retval, flags
    regs = dict.fromkeys(abi.REG_NAMES, 0)
    regs.update(di=0x1000, si=4 << 20, ip=GETPID_ADDR + (4 if GETPID.skipped_endbr else 0))
    for i, name in enumerate(abi.REG_NAMES):
        ev.regs[i] = regs[name]
    ev.comm = b"gf-test"
    ev.stack[0] = GETPID_ADDR
    ev.stack_bytes = 8
    return bytes(ev)


def proc(kind: int, signo: int = 0, code: int = 0) -> bytes:
    ev = abi.ProcEvent()
    ev.hdr.kind, ev.hdr.size = abi.REC_PROC, ctypes.sizeof(abi.ProcEvent)
    ev.ts_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    ev.pid, ev.tid, ev.kind, ev.signo, ev.code = PID, TID, kind, signo, code
    return bytes(ev)


def span(*records: bytes) -> bytes:
    """A take_span() copy: each record behind its 8-byte ring header, 8-aligned."""
    out = b""
    for r in records:
        out += struct.pack("=II", len(r), 0) + r + b"\0" * (-(len(r) + HDR) % 8)
    return out


def call(seq: int, *, ret: int = -5, latency_ns: int = 5000, kind: int = abi.EV_CALL) -> tuple:
    """A call record as RingReader.read_fixed returns it."""
    v = dict.fromkeys(abi.CALL_SCALARS, 0)
    v.update(
        ring_len=CALL_REC.size - HDR,
        kind=kind,
        size=ctypes.sizeof(abi.CallEvent),
        ts_ns=time.clock_gettime_ns(time.CLOCK_MONOTONIC),
        latency_ns=latency_ns,
        cookie=abi.cookie(0, 0),
        call_seq=3,
        fault_seq=seq,
        ret=ret,
        pid=PID,
        tid=TID,
    )
    return CALL_REC.unpack(CALL_REC.pack(*(v[k] for k in abi.CALL_SCALARS)))


def count_updates(r: Run) -> None:
    r.db.conn.executescript(
        "CREATE TEMP TABLE upd (n INTEGER); "
        "CREATE TEMP TRIGGER count_upd AFTER UPDATE ON main.faults "
        "BEGIN INSERT INTO upd VALUES (1); END;"
    )


def updates(r: Run) -> int:
    return r.rows("SELECT count(*) FROM upd")[0][0]


def test_fire_and_its_return_in_one_drain_make_one_row_written_once(fail_run: Run) -> None:
    r = fail_run
    count_updates(r)
    r.w.journal_fires(span(fire(1)), 1)
    assert r.rows("SELECT n FROM fire_journal") == [(1,)]  # stored raw first
    r.w.ingest_calls([call(1)])  # the return, read before the fire is decoded
    r.w.decode_journal(None)
    assert r.rows("SELECT count(*) FROM fire_journal") == [(0,)]
    assert r.rows(
        "SELECT fault_id, function, action, mechanism, retval, ret, latency_ns FROM faults"
    ) == [(r.fid(1), "getpid", "fail", "copilot", -5, -5, 5000)]
    assert updates(r) == 0  # inserted whole
    assert r.rows("SELECT count(*) FROM calls") == [(1,)]
    assert dict(r.rows("SELECT reg, value FROM registers"))["si"] == 4 << 20
    assert r.rows("SELECT idx, raw FROM args ORDER BY idx")[:2] == [(1, 0x1000), (2, 4 << 20)]
    assert [f["fault_id"] for f in r.fired] == [r.fid(1)]
    assert r.w.stats.fires == 1 and r.w.stats.events == 1
    text = r.show(1)
    assert text.startswith(f"fault {r.fid(1)}  (libc:getpid fail ret=-5 mode=skip)")
    # One name, the canonical one, with the site's other names noted.
    assert "  call      getpid (alias __getpid) #3 in " in text
    assert r.rows("SELECT symbol, aliases FROM funcs") == [("getpid", '["__getpid"]')]
    assert f"pid {PID} tid {TID} (gf-test)" in text
    returned = next(ln for ln in text.splitlines() if ln.startswith("  returned"))
    assert "-5" in returned and "(no return seen)" not in returned
    (frame,) = r.rows("SELECT depth, address, symbol FROM stacks")
    assert frame[:2] == (0, abi.s64(GETPID_ADDR)) and "getpid" in frame[2]
    assert "getpid" in text.split("  stack", 1)[1]


def test_a_return_after_the_row_updates_ret_and_latency(fail_run: Run) -> None:
    r = fail_run
    count_updates(r)
    r.w.journal_fires(span(fire(1)), 1)
    r.w.decode_journal(None)
    assert r.rows("SELECT ret, latency_ns FROM faults") == [(None, None)]
    assert "(no return seen)" in r.show(1)
    r.w.ingest_calls([call(1, latency_ns=7000)])  # a later drain: the documented update
    assert r.rows("SELECT ret, latency_ns FROM faults") == [(-5, 7000)]
    assert updates(r) == 1


def stopped(seq: int, *, stop_ns: int, resume_ns: int = 0, error: str | None = None) -> Outcome:
    """What the copilot hands over for one injection it handled."""
    return Outcome(
        tid=TID,
        fault_seq=seq,
        action=abi.ACT_FAIL,
        stop_ns=stop_ns,
        resume_ns=resume_ns,
        ip_before=1,
        ip_after=2,
        ret_addr=3,
        error=error,
    )


def test_copilot_outcomes_go_into_the_row_or_update_it_once_late(fail_run: Run) -> None:
    r = fail_run
    count_updates(r)
    early = stopped(1, stop_ns=10, resume_ns=20)
    r.w.outcomes.put(early)
    r.w.take_outcomes()
    r.w.journal_fires(span(fire(1), fire(2)), 2)
    r.w.decode_journal(None)
    o1 = json.loads(r.rows("SELECT outcome FROM faults WHERE seq=1")[0][0])
    assert o1["injected"] is True and o1["copilot"]["stop_ns"] == 10
    assert r.rows("SELECT outcome FROM faults WHERE seq=2") == [(None,)]
    assert updates(r) == 0
    r.w.outcomes.put(stopped(2, stop_ns=30, error="thread gone"))
    r.w.take_outcomes()
    r.w.update_outcomes()
    o2 = json.loads(r.rows("SELECT outcome FROM faults WHERE seq=2")[0][0])
    assert o2["injected"] is False and o2["copilot"]["error"] == "thread gone"
    assert updates(r) == 1
    assert "NOT injected: thread gone" in r.show(2)


def test_a_corrupt_outcome_is_merged(tmp_path: Path) -> None:
    r = Run(
        tmp_path / "x.db",
        FaultSpec(lib="libc", fn="getpid", action="corrupt", corrupt=(1, 0, 0, 0, 8)),
    )
    r.w.outcomes.put(CorruptOutcome(1, TID, 0x1000, "write 0x1000: Bad address"))
    r.w.take_outcomes()
    r.w.journal_fires(span(fire(1, action=abi.ACT_CORRUPT, retval=0)), 1)
    r.w.decode_journal(None)
    o = json.loads(r.rows("SELECT outcome FROM faults")[0][0])
    assert o == {
        "corrupt_addr": 0x1000,
        "corrupt_error": "write 0x1000: Bad address",
        "injected": False,
    }
    r.db.close()


def test_copilot_fires_without_a_stop_are_marked_not_injected(fail_run: Run) -> None:
    r = fail_run
    r.w.journal_fires(span(fire(1)), 1)
    r.w.ingest_calls([call(1)])
    r.w.decode_journal(None)
    r.w.mark_uninjected()
    outcome, ret = r.rows("SELECT outcome, ret FROM faults")[0]
    assert json.loads(outcome) == {"injected": False, "error": NOT_INJECTED} and ret is None
    assert "NOT injected: no copilot stop was seen" in r.show(1)


def test_process_events_link_to_the_latest_fault_of_their_process(tmp_path: Path) -> None:
    r = Run(
        tmp_path / "x.db", FaultSpec(lib="libc", fn="getpid", action="signal", signo=signal.SIGSEGV)
    )
    recs = [
        proc(abi.PROC_SIGNAL, signal.SIGCHLD, 1),  # before any fault: unattributed
        fire(1, action=abi.ACT_SIGNAL, mech=0, retval=0),
        proc(abi.PROC_SIGNAL, signal.SIGSEGV, 0),  # the injected one
        proc(abi.PROC_SIGNAL, signal.SIGWINCH, 0),  # not the fault's doing
        proc(abi.PROC_EXIT, code=signal.SIGSEGV | 0x80),
    ]
    r.w.journal_fires(span(*recs), len(recs))
    r.w.decode_journal(None)
    links = r.rows("SELECT fault_id, kind, rule, detail FROM links ORDER BY rowid")
    assert [(f, k, rule) for f, k, rule, _ in links] == [
        (None, "signal", "unattributed"),
        (r.fid(1), "signal", "signal-in-faulted-process"),
        (None, "signal", "unattributed"),
        (r.fid(1), "exit", "exit-of-faulted-process"),
    ]
    assert json.loads(links[1][3])["cause"] == "injected signal"
    assert json.loads(links[3][3]) == {
        "exit_status": 0,
        "term_signal": signal.SIGSEGV,
        "core": True,
    }
    assert json.loads(r.rows("SELECT outcome FROM faults")[0][0]) == {"signal": signal.SIGSEGV}
    text = r.show(1)
    assert "signal-in-faulted-process" in text and "exit-of-faulted-process" in text
    assert r.w.stats.links == 4
    r.db.close()


def test_the_next_failing_return_of_the_thread_is_linked(fail_run: Run) -> None:
    r = fail_run
    r.w.journal_fires(span(fire(1)), 1)
    r.w.decode_journal(None)
    r.w.ingest_calls([call(1, ret=-12, kind=abi.EV_FOLLOW)])
    assert r.rows("SELECT ret FROM faults") == [(None,)]  # a follow is not the fault's return
    (link,) = r.rows("SELECT fault_id, kind, rule, detail FROM links")
    assert link[:3] == (r.fid(1), "error-return", "same-thread-next-error")
    assert json.loads(link[3]) == {"func": 0, "ret": -12}
    assert "same-thread-next-error" in r.show(1)


def test_journal_batches_beyond_memory_are_read_back_in_order(fail_run: Run) -> None:
    r = fail_run
    r.w._JOURNAL_MEMORY_BATCHES = 1  # older batches: only in fire_journal
    for seq in (1, 2, 3):
        r.w.journal_fires(span(fire(seq)), 1)
    assert r.rows("SELECT batch, n FROM fire_journal ORDER BY batch") == [(1, 1), (2, 1), (3, 1)]
    r.w.decode_journal(None)
    assert r.rows("SELECT seq FROM faults ORDER BY seq") == [(1,), (2,), (3,)]
    assert r.rows("SELECT count(*) FROM fire_journal") == [(0,)]
    assert [f["seq"] for f in r.fired] == [1, 2, 3]


def test_a_decode_that_fails_leaves_its_batch_in_the_journal(fail_run: Run) -> None:
    r = fail_run
    r.w.journal_fires(span(fire(1)), 1)
    r.db.conn.execute(
        "CREATE TEMP TRIGGER boom BEFORE INSERT ON main.stacks "
        "BEGIN SELECT RAISE(ABORT, 'boom'); END"
    )
    with pytest.raises(sqlite3.IntegrityError, match="boom"):
        r.w.decode_journal(None)
    # In the journal or in the tables, never in both or neither.
    assert r.rows("SELECT count(*) FROM faults") == [(0,)]
    assert r.rows("SELECT n FROM fire_journal") == [(1,)]


def test_call_rows_stop_at_the_size_cap_and_are_counted(tmp_path: Path) -> None:
    r = Run(tmp_path / "x.db", FaultSpec(lib="libc", fn="getpid", trace=True), max_db_bytes=1)
    notes: list[str] = []
    r.w.on_notice = notes.append
    r.w.ingest_calls([call(0), call(0)])
    assert r.w.capped and r.w.stats.dropped == 2
    assert r.rows("SELECT count(*) FROM calls") == [(0,)]
    assert len(notes) == 1 and "--max-db-size" in notes[0]
    r.db.close()


# ---- values that agree with `show` (issue 22) -------------------------------------


def held(seq: int, *, stop_ns: int, resume_ns: int, error: str | None = None) -> Outcome:
    """A stall's outcome: the copilot held the thread from stop to resume."""
    return Outcome(TID, seq, abi.ACT_STALL, stop_ns, resume_ns, 1, 1, 0, error)


@pytest.mark.parametrize("outcome_first", [True, False])
def test_a_stall_stores_how_long_the_thread_was_held(tmp_path: Path, outcome_first: bool) -> None:
    r = Run(tmp_path / "x.db", FaultSpec(lib="libc", fn="getpid", action="stall", stall_ms=20))
    out = held(1, stop_ns=10_000_000, resume_ns=30_100_000)  # 20.1 ms
    if outcome_first:
        r.w.outcomes.put(out)
        r.w.take_outcomes()
    # No return probe on a stall: its entry record says ret 0, latency 0.
    r.w.journal_fires(span(fire(1, action=abi.ACT_STALL, retval=0)), 1)
    r.w.ingest_calls([call(1, ret=0, latency_ns=0, kind=abi.EV_ENTRY)])
    r.w.decode_journal(None)
    if not outcome_first:
        r.w.outcomes.put(out)
        r.w.take_outcomes()
        r.w.update_outcomes()
    assert r.rows("SELECT ret, latency_ns FROM faults") == [(None, 20_100_000)]
    text = r.show(1)
    assert "held the thread 20.1 ms" in text
    assert "  returned  (no return seen) after a hold of 20.1 ms" in text
    (ms,) = r.rows("SELECT latency_ms FROM faults_readable")[0]
    assert ms == pytest.approx(20.1)
    r.db.close()


def test_an_entry_record_of_a_fail_keeps_its_injected_ret_and_no_latency(fail_run: Run) -> None:
    r = fail_run
    r.w.journal_fires(span(fire(1)), 1)
    r.w.ingest_calls([call(1, ret=-5, latency_ns=0, kind=abi.EV_ENTRY)])
    r.w.decode_journal(None)
    assert r.rows("SELECT ret, latency_ns FROM faults") == [(-5, None)]


def test_a_signal_that_killed_the_process_stores_that_the_call_did_not_return(
    tmp_path: Path,
) -> None:
    r = Run(
        tmp_path / "x.db", FaultSpec(lib="libc", fn="getpid", action="signal", signo=signal.SIGABRT)
    )
    recs = [
        fire(1, action=abi.ACT_SIGNAL, mech=0, retval=0),
        proc(abi.PROC_SIGNAL, signal.SIGABRT, 0),
        proc(abi.PROC_EXIT, code=signal.SIGABRT | 0x80),
    ]
    r.w.journal_fires(span(*recs), len(recs))
    r.w.ingest_calls([call(1, ret=0, latency_ns=0, kind=abi.EV_ENTRY)])
    r.w.decode_journal(None)
    assert r.rows("SELECT ret, latency_ns FROM faults") == [(None, None)]  # never "returned 0"
    r.w.mark_unreturned()
    (o,) = r.rows("SELECT outcome FROM faults")[0]
    o = json.loads(o)
    assert o["returned"] is False and "SIGABRT" in o["no_return"]
    line = next(ln for ln in r.show(1).splitlines() if ln.startswith("  returned"))
    assert line.startswith("  returned  did not return (the process was killed by SIGABRT")
    r.db.close()


def test_a_signal_fault_in_a_process_that_lived_says_no_return_seen(tmp_path: Path) -> None:
    r = Run(
        tmp_path / "x.db", FaultSpec(lib="libc", fn="getpid", action="signal", signo=signal.SIGUSR1)
    )
    r.w.journal_fires(span(fire(1, action=abi.ACT_SIGNAL, mech=0, retval=0)), 1)
    r.w.ingest_calls([call(1, ret=0, latency_ns=0, kind=abi.EV_ENTRY)])
    r.w.decode_journal(None)
    r.w.mark_unreturned()
    assert r.rows("SELECT ret, outcome FROM faults") == [(None, '{"signal": 10}')]
    assert "  returned  (no return seen)" in r.show(1)
    r.db.close()


def test_a_thread_that_died_while_held_did_not_return(tmp_path: Path) -> None:
    r = Run(tmp_path / "x.db", FaultSpec(lib="libc", fn="getpid", action="stall"))
    r.w.journal_fires(span(fire(1, action=abi.ACT_STALL, retval=0)), 1)
    r.w.decode_journal(None)
    r.w.outcomes.put(held(1, stop_ns=10, resume_ns=0, error="thread exited during stall"))
    r.w.take_outcomes()
    r.w.update_outcomes()
    assert r.rows("SELECT ret, latency_ns FROM faults") == [(None, None)]
    assert "  returned  did not return (thread exited during stall)" in r.show(1)
    r.db.close()
