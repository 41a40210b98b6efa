"""Xid recording (bpf/xid.bpf.c + pyctl/xid.py).

No NVIDIA driver runs here, so: the format parser is checked against the
nvidia_dev_xid format file (tests/device/nvidia_dev_xid.format; the device
run captures the real one into its results), start() must refuse cleanly
when the tracepoint is absent, and the BPF program itself runs for real on
one of this kernel's own tracepoints with the same field shapes
(sched:sched_process_exec: a __data_loc string and a 4-byte integer).

Beside an engine the monitor writes through the engine's connection (one
writer per run, one transaction per batch, never closed by the monitor) and
the runner closes it before the engine ends the run row: unit tests with a
stand-in engine, and one root test with a real Engine and tracepoint.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from pyctl import runner, xid
from pyctl.evidence import store
from pyctl.spec import FaultSpec

FORMAT = Path(__file__).resolve().parent / "device" / "nvidia_dev_xid.format"


def test_parse_nvidia_format() -> None:
    lay = xid.Layout.from_format(FORMAT.read_text())
    assert (lay.dev.offset, lay.dev.data_loc) == (8, True)
    assert (lay.code.offset, lay.code.size, lay.code.data_loc) == (12, 4, False)
    assert lay.msg is not None and (lay.msg.offset, lay.msg.data_loc) == (16, True)
    assert lay.rodata() == {
        "off_dev": 8,
        "dev_loc": 1,
        "off_code": 12,
        "size_code": 4,
        "off_msg": 16,
        "msg_loc": 1,
        "has_msg": 1,
    }


def test_parse_inline_char_array_and_common_fields() -> None:
    text = (
        "\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;\n"
        "\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n"
        "\tfield:u64 code;\toffset:24;\tsize:8;\tsigned:0;\n"
    )
    f = xid.parse_format(text)
    assert f["comm"] == xid.Field("comm", 8, 16, False)
    lay = xid.Layout.from_format(text, "comm", "code", None)
    assert lay.rodata()["size_code"] == 8 and lay.rodata()["has_msg"] == 0


def test_format_missing_field_is_one_line_error() -> None:
    with pytest.raises(xid.XidError, match="lacks field"):
        xid.Layout.from_format("\tfield:u32 error_code;\toffset:12;\tsize:4;\tsigned:0;\n")


def test_event_unpack_matches_c_struct() -> None:
    # struct xid_event: u64 ts, u64 code, u32 pid, u32 tid, char dev[32], char msg[128]
    assert xid.EVENT_FMT.size == 8 + 8 + 4 + 4 + 32 + 128
    raw = xid.EVENT_FMT.pack(5, 13, 7, 8, b"0000:18:00.0", b"Graphics Exception")
    x = xid.Xid.unpack(raw)
    assert (x.ts_ns, x.error_code, x.pid, x.tid, x.dev, x.msg) == (
        5,
        13,
        7,
        8,
        "0000:18:00.0",
        "Graphics Exception",
    )


@pytest.mark.root
def test_refused_cleanly_without_nvidia_tracepoint(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("requires root (BPF)")
    if xid.format_path() is not None:
        pytest.skip("this host has the NVIDIA Xid tracepoint: nothing to refuse")
    db = tmp_path / "x.db"
    mon = xid.XidMonitor(db)
    with pytest.raises(xid.XidError, match="absent|tracefs"):
        mon.start()
    assert not db.exists() and mon.obj is None


def _linked_monitor(tmp_path: Path) -> xid.XidMonitor:
    if os.geteuid() != 0:
        pytest.skip("requires root (BPF)")
    if xid.format_path("sched", "sched_process_exec") is None:
        pytest.skip("sched:sched_process_exec missing")
    if not xid.XID_OBJ.exists():
        pytest.skip("pyctl/data/xid.bpf.o missing: run make build")
    return xid.XidMonitor(tmp_path / "x.db", **_SCHED)


# The exec'd file name plays the Xid's dev string, the new pid its code.
_SCHED: dict = {
    "category": "sched",
    "event": "sched_process_exec",
    "fields": ("filename", "pid", "filename"),
    "minor_of": lambda dev: 0 if dev.endswith("gfxid-probe") else None,
}


@pytest.mark.root
def test_bpf_program_records_a_real_tracepoint(tmp_path: Path, tracefs_mounted: str) -> None:
    mon = _linked_monitor(tmp_path)
    # dev[] holds 31 characters: a short path under /tmp, removed below.
    exe = Path("/tmp") / f"{uuid.uuid4().hex[:8]}-gfxid-probe"
    shutil.copy("/bin/true", exe)
    mon.start()
    try:
        # A fault row from a process that "has GPU minor 0 open": linked.
        db = store.open_db(tmp_path / "x.db")  # the engine's side of the store
        with db.conn:
            db["faults"].insert({"fault_id": "r1-1", "run_id": "r1", "pid": 4242, "ts_ns": 1})
        db.close()
        mon._pid_minors[4242] = {0}
        mon.window_ns = 1 << 62
        child = subprocess.run([str(exe)])
        got: list[xid.Xid] = []
        for _ in range(100):  # bounded: each poll waits for the ring's wake-up
            got += [x for x in mon.poll(0.1) if x.dev == str(exe)]
            if got:
                break
    finally:
        mon.close()
        exe.unlink()
    assert child.returncode == 0 and len(got) == 1
    assert got[0].error_code == got[0].pid  # `pid` field == the exec'ing task
    con = sqlite3.connect(tmp_path / "x.db")
    rows = con.execute(
        "SELECT fault_id, rule, dev, msg FROM xids WHERE dev=?", (str(exe),)
    ).fetchall()
    assert rows == [("r1-1", "xid-on-device-of-faulted-process", str(exe), str(exe))]
    other = con.execute(
        "SELECT count(*) FROM xids WHERE dev != ? AND fault_id IS NOT NULL", (str(exe),)
    ).fetchone()[0]
    assert other == 0  # other execs are not on "device 0": unattributed


def test_nvidia_minors_of_self_is_empty_here() -> None:
    assert xid.nvidia_minors_of(os.getpid()) == set()


# ---- one writer: beside an engine, the engine's connection -------------------


def _xid(ts_ns: int, pid: int = 42, msg: str = "MMU Fault") -> xid.Xid:
    return xid.Xid(ts_ns, 31, pid, pid, "0000:18:00.0", msg)


def _fake_engine(path: Path, run_id: str = "abcd1234") -> SimpleNamespace:
    """What XidMonitor.beside reads of a started Engine."""
    db = store.open_db(path)
    with db.conn:
        db["faults"].insert({"fault_id": f"{run_id}-1", "run_id": run_id, "pid": 42, "ts_ns": 100})
    return SimpleNamespace(db=db, db_path=path, run_id=run_id)


def _no_second_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the monitor opened a connection of its own")

    monkeypatch.setattr(store, "open_db", refuse)


def test_beside_engine_writes_through_its_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = _fake_engine(tmp_path / "x.db")
    _no_second_connection(monkeypatch)
    mon = xid.XidMonitor.beside(eng, minor_of=lambda dev: 0)
    assert mon.db is eng.db and not mon.owns_db and mon.run_id == eng.run_id
    mon._pid_minors[42] = {0}
    mon.record([_xid(150), _xid(50, pid=7)])  # the 2nd came before the fault
    assert mon.db is eng.db
    mon.close()
    # The engine's connection stays open for its own last writes...
    eng.db.conn.execute("SELECT count(*) FROM faults").fetchone()
    # ...and the rows are committed, in the engine's run, linked to its fault.
    con = sqlite3.connect(tmp_path / "x.db")
    rows = con.execute("SELECT run_id, fault_id, rule, pid FROM xids ORDER BY ts_ns").fetchall()
    con.close()
    assert rows == [
        ("abcd1234", None, "unattributed", 7),
        ("abcd1234", "abcd1234-1", "xid-on-device-of-faulted-process", 42),
    ]
    with pytest.raises(RuntimeError, match="closed"):
        mon.record([_xid(170)])  # never falls back to a connection of its own
    eng.db.close()


def test_beside_engine_refuses_another_thread(tmp_path: Path) -> None:
    eng = _fake_engine(tmp_path / "x.db")
    mon = xid.XidMonitor.beside(eng)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            mon.record([_xid(150)])
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert len(errors) == 1 and "another thread" in str(errors[0])
    # Nothing written (the table itself exists: open_db makes every table).
    assert eng.db.conn.execute("SELECT count(*) FROM xids").fetchone() == (0,)
    mon.close()
    eng.db.close()


def test_beside_needs_a_started_engine(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="start the engine"):
        xid.XidMonitor.beside(SimpleNamespace(db=None, db_path=tmp_path / "x.db", run_id=""))


def test_a_batch_is_one_transaction(tmp_path: Path) -> None:
    eng = _fake_engine(tmp_path / "x.db")
    mon = xid.XidMonitor.beside(eng)
    mon.record([_xid(150)])  # creates the table
    eng.db.conn.execute(
        "CREATE TRIGGER boom BEFORE INSERT ON xids WHEN NEW.msg = 'boom' "
        "BEGIN SELECT RAISE(ABORT, 'boom'); END"
    )
    with pytest.raises(sqlite3.IntegrityError, match="boom"):
        mon.record([_xid(160, msg="fine"), _xid(170, msg="boom")])
    msgs = [m for (m,) in eng.db.conn.execute("SELECT msg FROM xids ORDER BY ts_ns")]
    assert msgs == ["MMU Fault"]  # not "fine": the failed batch left nothing
    assert not eng.db.conn.in_transaction
    mon.close()
    eng.db.close()


def test_alone_the_monitor_owns_and_closes_its_connection(tmp_path: Path) -> None:
    mon = xid.XidMonitor(tmp_path / "x.db", run_id="r1")
    assert mon.db is None and mon.owns_db
    mon.record([_xid(150)])
    own = mon.db
    assert own is not None
    mon.close()
    assert mon.db is None
    with pytest.raises(sqlite3.ProgrammingError):
        own.conn.execute("SELECT 1")
    con = sqlite3.connect(tmp_path / "x.db")
    assert con.execute("SELECT run_id, rule FROM xids").fetchall() == [("r1", "unattributed")]
    con.close()


# ---- the runner: Xids end before the run row does -----------------------------


class _Log:
    def __init__(self, fail_close: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_close = fail_close


class _FakeEngineForRunner:
    def __init__(self, log: _Log) -> None:
        self.log, self.obj, self.db, self.copilot = log, object(), object(), None

    def drain(self) -> int:
        self.log.calls.append("engine.drain")
        return 0

    def close(self, status: str = "done", exit_code: int | None = None) -> None:
        self.log.calls.append(f"engine.close:{status}")


class _FakeMonitor:
    def __init__(self, log: _Log) -> None:
        self.log = log

    def close(self) -> None:
        self.log.calls.append("xids.close")
        if self.log.fail_close:
            raise OSError("ring gone")


def _runner(log: _Log) -> runner.Runner:
    r = runner.Runner(
        [], runner.Target(pid=1), db_path="unused.db", argv=[], kind="inject", status=False
    )
    r.engine = _FakeEngineForRunner(log)  # type: ignore[assignment]
    r.xids = _FakeMonitor(log)
    return r


def test_runner_finish_ends_xids_before_the_run() -> None:
    log = _Log()
    r = _runner(log)
    r.finish()
    # The engine's fires are in (a last Xid can link to them), the Xids are
    # written, and only then is the run row ended and its connection closed.
    assert log.calls == ["engine.drain", "xids.close", "engine.close:done"]
    assert r.xids is None


def test_runner_finish_ends_the_run_even_if_the_monitor_fails() -> None:
    log = _Log(fail_close=True)
    with pytest.raises(OSError, match="ring gone"):
        _runner(log).finish()
    assert log.calls == ["engine.drain", "xids.close", "engine.close:done"]


def test_runner_detach_ends_xids_before_the_run() -> None:
    log = _Log()
    r = _runner(log)
    r.child = subprocess.Popen(["sleep", "0.2"])  # still running: the run detaches
    assert r._child_rc() == 0
    assert log.calls == ["engine.drain", "xids.close", "engine.close:detached"]
    r.finish()  # nothing left for the monitor; the engine's close is idempotent
    assert log.calls[3:] == ["engine.close:done"]


@pytest.mark.root
def test_runner_records_xids_in_its_run_through_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tracefs_mounted: str
) -> None:
    """A real engine and a real tracepoint: the Xid lands in the engine's run,
    linked to its fault, with no second connection, before the run ends."""
    _linked_monitor(tmp_path)  # the same skips
    from gftarget import LIB, TARGET, Target

    if not TARGET.exists():
        pytest.skip("build/targets/gf_target missing: run make build")
    beside = xid.XidMonitor.beside.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        xid.XidMonitor, "beside", classmethod(lambda cls, eng: beside(cls, eng, **_SCHED))
    )
    exe = Path("/tmp") / f"{uuid.uuid4().hex[:8]}-gfxid-probe"
    shutil.copy("/bin/true", exe)
    t = Target()
    db = tmp_path / "x.db"
    # SIGWINCH, ignored: a fault that fires and leaves the target running.
    sp = FaultSpec(
        lib=str(LIB), fn="gf_victim", action="signal", signo=28, nth=1, capture_stack=False
    )
    r = runner.Runner(
        [sp], runner.Target(pid=t.pid), db_path=db, argv=["test"], kind="inject", status=False
    )
    try:
        eng = r.start()
        eng.on_fire = r.note_fire
        mon = r.xids
        assert mon is not None and mon.db is eng.db and not mon.owns_db
        _no_second_connection(monkeypatch)
        mon._pid_minors[t.pid] = {0}  # the target "has GPU minor 0 open"
        t.victim(1)
        eng.drain()
        subprocess.run([str(exe)], check=True)
        for _ in range(100):  # bounded: each poll waits for the ring's wake-up
            if any(x.dev == str(exe) for x in mon.poll(0.1)):
                break
        run_id = eng.run_id
    finally:
        r.finish()
        t.close()
        exe.unlink()
    con = sqlite3.connect(db)
    rows = con.execute(
        "SELECT run_id, fault_id, rule FROM xids WHERE dev=?", (str(exe),)
    ).fetchall()
    ended = con.execute("SELECT status, ended FROM runs WHERE run_id=?", (run_id,)).fetchone()
    con.close()
    assert rows == [(run_id, f"{run_id}-1", "xid-on-device-of-faulted-process")]
    assert ended[0] == "done" and ended[1] is not None


def test_runner_without_xids_starts_no_monitor() -> None:
    r = runner.Runner(
        [],
        runner.Target(pid=1),
        db_path="unused.db",
        argv=[],
        kind="inject",
        status=False,
        xids=False,
    )
    r.engine = _FakeEngineForRunner(_Log())  # type: ignore[assignment]
    r._start_xids()
    assert r.xids is None


def test_template_run_no_xids_reaches_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    # `template run` records Xids only through the runner's monitor (one
    # writer); --no-xids switches that monitor off.
    from click.testing import CliRunner

    from pyctl.cli import launch
    from pyctl.cli import template as templates_cli

    seen: list[bool] = []
    # The run's settings travel as one RunOptions (pyctl/run_options.py).
    monkeypatch.setattr(launch, "run_specs", lambda *a, **kw: seen.append(a[1].xids))
    for flag, want in (("--no-xids", False), ("--xids", True)):
        res = CliRunner().invoke(
            templates_cli.template, ["run", "cuda-oom-sticky", "--pid", "1", flag]
        )
        assert res.exit_code == 0, res.output
        assert seen[-1] is want


@pytest.mark.root
def test_raw_tracepoint_trial_needs_no_tracefs() -> None:
    """doctor's Xid check is a trial attach by name (the H200 host's kallsyms
    does not list the driver's tracepoint): here a kernel tracepoint stands
    in for the driver's, and a missing one says no; nothing stays attached."""
    if os.geteuid() != 0:
        pytest.skip("requires root (BPF)")
    if not xid.XID_OBJ.exists():
        pytest.skip("pyctl/data/xid.bpf.o missing: run make build")
    assert xid.raw_tracepoint_attaches("sched_process_exec") is True
    assert xid.raw_tracepoint_attaches("gf_no_such_tracepoint") is False


def test_event_format_matches_the_shared_header(tmp_path: Path) -> None:
    """bpf/xid.h is the one definition of the Xid record: the C compiler's
    sizes and offsets equal what pyctl/xid.py's EVENT_FMT unpacks."""
    import struct as S

    import c_header

    fields = ["ts_ns", "error_code", "pid", "tid", "dev", "msg"]
    c = c_header.values(
        tmp_path,
        "xid.h",
        ["sizeof(struct xid_event)", "XID_DEV_LEN", "XID_MSG_LEN"]
        + [f"offsetof(struct xid_event, {f})" for f in fields],
    )
    assert (c["XID_DEV_LEN"], c["XID_MSG_LEN"]) == (xid.DEV_LEN, xid.MSG_LEN)
    assert c["sizeof(struct xid_event)"] == xid.EVENT_FMT.size
    codes = xid.EVENT_FMT.format.lstrip("=")
    sizes = [S.calcsize("=" + ch) for ch in ("Q", "Q", "I", "I")] + [xid.DEV_LEN, xid.MSG_LEN]
    off = 0
    for f, size in zip(fields, sizes, strict=True):
        assert c[f"offsetof(struct xid_event, {f})"] == off, f
        off += size
    assert codes.startswith("QQII")
