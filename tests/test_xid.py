"""Xid recording (bpf/xid.bpf.c + pyctl/xid.py).

No NVIDIA driver runs here, so: the format parser is checked against the
nvidia_dev_xid format file (tests/device/nvidia_dev_xid.format; the device
run captures the real one into its results), start() must refuse cleanly
when the tracepoint is absent, and the BPF program itself runs for real on
one of this kernel's own tracepoints with the same field shapes
(sched:sched_process_exec: a __data_loc string and a 4-byte integer).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import uuid
from pathlib import Path

import pytest

from pyctl import store, xid

FORMAT = Path(__file__).resolve().parent / "device" / "nvidia_dev_xid.format"


def test_parse_nvidia_format() -> None:
    lay = xid.Layout.from_format(FORMAT.read_text())
    assert (lay.dev.offset, lay.dev.data_loc) == (8, True)
    assert (lay.code.offset, lay.code.size, lay.code.data_loc) == (12, 4, False)
    assert lay.msg is not None and (lay.msg.offset, lay.msg.data_loc) == (16, True)
    assert lay.rodata() == {"off_dev": 8, "dev_loc": 1, "off_code": 12, "size_code": 4,
                            "off_msg": 16, "msg_loc": 1, "has_msg": 1}


def test_parse_inline_char_array_and_common_fields() -> None:
    text = ("\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;\n"
            "\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n"
            "\tfield:u64 code;\toffset:24;\tsize:8;\tsigned:0;\n")
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
        5, 13, 7, 8, "0000:18:00.0", "Graphics Exception")


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
        pytest.skip("tracefs or sched:sched_process_exec missing")
    if not xid.XID_OBJ.exists():
        pytest.skip("pyctl/data/xid.bpf.o missing: run make build")
    # The exec'd file name plays the Xid's dev string, the new pid its code.
    return xid.XidMonitor(tmp_path / "x.db", category="sched", event="sched_process_exec",
                          fields=("filename", "pid", "filename"),
                          minor_of=lambda dev: 0 if dev.endswith("gfxid-probe") else None)


@pytest.mark.root
def test_bpf_program_records_a_real_tracepoint(tmp_path: Path) -> None:
    mon = _linked_monitor(tmp_path)
    # dev[] holds 31 characters: a short path under /tmp, removed below.
    exe = Path("/tmp") / f"{uuid.uuid4().hex[:8]}-gfxid-probe"
    shutil.copy("/bin/true", exe)
    mon.start()
    try:
        # A fault row from a process that "has GPU minor 0 open": linked.
        db = store.open_db(tmp_path / "x.db")  # the engine's side of the store
        db["faults"].insert({"fault_id": "r1-1", "run_id": "r1", "pid": 4242, "ts_ns": 1},
                            alter=True)
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
    rows = con.execute("SELECT fault_id, rule, dev, msg FROM xids WHERE dev=?",
                       (str(exe),)).fetchall()
    assert rows == [("r1-1", "xid-on-device-of-faulted-process", str(exe), str(exe))]
    other = con.execute("SELECT count(*) FROM xids WHERE dev != ? AND fault_id IS NOT NULL",
                        (str(exe),)).fetchone()[0]
    assert other == 0  # other execs are not on "device 0": unattributed


def test_nvidia_minors_of_self_is_empty_here() -> None:
    assert xid.nvidia_minors_of(os.getpid()) == set()
