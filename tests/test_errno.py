"""A fail that also sets errno (--errno): the application's own message
(strerror(errno), printed by build/targets/gf_errno after its libc call)
is the injected error's, in the faulted thread only; refused with one
line where it cannot be done."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from gftarget import REPO

from pyctl.copilot.errno_tls import ErrnoError, tls_offset
from pyctl.engine import Engine, EngineError
from pyctl.engine.mechanism import Plan
from pyctl.spec import FaultSpec, SpecError, parse_errno

TARGET = REPO / "build" / "targets" / "gf_errno"
LINE = re.compile(r"access t=(\d+) i=(\d+) ret=(-?\d+) errno=(\d+) msg=(.*)")


class ErrnoTarget:
    def __init__(self) -> None:
        self.p = subprocess.Popen(
            [str(TARGET)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        assert self.p.stdout is not None
        assert self.p.stdout.readline().startswith("ready")
        self.pid = self.p.pid

    def cmd(self, line: str) -> list[str]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        out = []
        while (ln := self.p.stdout.readline().strip()) != "done":
            if not ln and self.p.poll() is not None:
                raise EOFError(f"target exited during {line!r}")
            out.append(ln)
        return out

    def access(self, n: int, threads: int = 0) -> list[tuple[int, int, int, int, str]]:
        return sorted(
            (int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5])
            for ln in self.cmd(f"access {n} {threads}")
            if (m := LINE.match(ln))
        )

    def close(self) -> None:
        if self.p.poll() is None:
            assert self.p.stdin is not None
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
        self.p.wait(timeout=10)


@pytest.fixture
def etarget() -> Iterator[ErrnoTarget]:
    if not TARGET.exists():  # pragma: no cover - make build makes it
        pytest.skip("build/targets/gf_errno missing: run make build")
    t = ErrnoTarget()
    yield t
    t.close()


def test_errno_names_and_numbers() -> None:
    assert parse_errno("EIO") == parse_errno("eio") == parse_errno("5") == 5
    for bad in ("EFOO", "0", "4096", "SIGSEGV"):
        with pytest.raises(SpecError, match="--errno"):
            parse_errno(bad)
    with pytest.raises(SpecError, match="--errno goes with --action fail"):
        FaultSpec.from_fields({"lib": "libc", "fn": "access", "action": "stall", "errno": "EIO"})
    s = FaultSpec.from_fields(
        {"lib": "libc", "fn": "access", "action": "fail", "ret": "-1", "errno": "EIO"}
    )
    assert s.describe() == "libc:access fail ret=-1 mode=skip errno=EIO"
    assert s.to_bpf().corrupt_mask == 5
    from pyctl.api import Fault

    assert Fault.fail("libc", "access", ret=-1, errno="EIO") == s
    assert Fault.fail("libc", "access", ret=-1).errno == 0


def test_a_bpf_register_fail_refuses_errno() -> None:
    s = FaultSpec(lib="libc", fn="access", action="fail", ret=-1, errno=5)
    assert "--errno" in (Plan([s], regs=True, user_writes=True).errno_refusal() or "")
    assert Plan([s], regs=False, user_writes=True).errno_refusal() is None


@pytest.mark.root
def test_the_tls_offset_is_where_the_target_says_errno_is(etarget: ErrnoTarget) -> None:
    (line,) = etarget.cmd("where")
    m = re.fullmatch(r"errno_at tid=(\d+) addr=0x([0-9a-f]+)", line)
    assert m
    # The main thread's fs_base, from /proc (no ptrace needed for this check).
    fs = ptrace_free_fs_base(etarget.pid)
    assert fs + tls_offset(etarget.pid) == int(m[2], 16)


def ptrace_free_fs_base(pid: int) -> int:
    """A stopped-by-us thread's fs_base, read through ptrace in a child
    (SEIZE, INTERRUPT, GETREGS, DETACH): what the copilot sees."""
    from pyctl.copilot import ptrace

    code = (
        "import os, sys\n"
        "from pyctl.copilot import ptrace\n"
        f"t = {pid}\n"
        "ptrace.seize(t, 0); ptrace.interrupt(t); os.waitpid(t, ptrace.WALL)\n"
        "print(ptrace.getregs(t)[ptrace.REG['fs_base']]); ptrace.detach(t)\n"
    )
    out = subprocess.run(
        ["python3", "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    assert ptrace.REG["fs_base"]
    return int(out)


def test_no_glibc_is_one_line() -> None:
    with pytest.raises(ErrnoError, match="cannot read its maps|no glibc"):
        tls_offset(2**22 + 11)


@pytest.mark.root
@pytest.mark.parametrize("mode", ["skip", "after"])
def test_a_failed_access_reports_the_injected_errno(
    etarget: ErrnoTarget, tmp_path: Path, mode: str
) -> None:
    db = tmp_path / "gf.db"
    s = FaultSpec(
        lib="libc", fn="access", action="fail", ret=-1, errno=5, mode=mode, nth=2, tgid=etarget.pid
    )
    # The copilot's errno outcome (where it wrote errno): named, since a
    # fail-skip goes through the signal helper by default (its errno:
    # tests/test_fastpath.py test_errno_set_by_the_handler).
    eng = Engine([s], db_path=db, pid=etarget.pid, argv=["test"], mechanism="copilot")
    eng.start()
    try:
        rows = etarget.access(3)
        eng.drain()
    finally:
        eng.close()
    assert rows == [
        (0, 1, 0, 0, "Success"),
        (0, 2, -1, 5, "Input/output error"),  # the application's own words
        (0, 3, 0, 0, "Success"),
    ]
    con = sqlite3.connect(db)
    ((outcome,),) = con.execute("SELECT outcome FROM faults").fetchall()
    cop = json.loads(outcome)["copilot"]
    assert cop["errno"] == 5 and cop["errno_addr"] and json.loads(outcome)["injected"] is True
    from pyctl.evidence import query, store

    d = store.open_db(db, readonly=True)
    text = query.render_chain(query.fault_chain(d, query.latest_fault(d)))
    d.close()
    assert "injected -1, errno EIO (5)" in text


@pytest.mark.root
def test_errno_is_set_in_each_faulted_thread_only(etarget: ErrnoTarget, tmp_path: Path) -> None:
    s = FaultSpec(lib="libc", fn="access", action="fail", ret=-1, errno=28, nth=1, tgid=etarget.pid)
    eng = Engine([s], db_path=tmp_path / "gf.db", pid=etarget.pid, argv=["test"])
    eng.start()
    try:
        rows = etarget.access(2, threads=3)
    finally:
        eng.close()
    failed = [r for r in rows if r[2] == -1]
    # One call fails (nth=1), with ENOSPC in its own thread; every other
    # call, in that thread and the other two, keeps errno 0.
    assert [r[3:] for r in failed] == [(28, os.strerror(28))]
    assert all(r[3] == 0 for r in rows if r[2] == 0) and len(rows) == 6


@pytest.mark.root
def test_a_target_without_glibc_is_refused_before_attach(tmp_path: Path) -> None:
    import shutil

    static = tmp_path / "static"
    src = tmp_path / "s.c"
    src.write_text("#include <unistd.h>\nint main(void){pause();return 0;}\n")
    if not shutil.which("gcc"):  # pragma: no cover
        pytest.skip("no gcc")
    r = subprocess.run(["gcc", "-static", "-o", static, src], capture_output=True)
    if r.returncode:  # pragma: no cover - no static libc installed
        pytest.skip("gcc -static: no static libc here")
    p = subprocess.Popen([static])
    try:
        s = FaultSpec(lib=str(static), fn="pause", action="fail", ret=-1, errno=5, tgid=p.pid)
        with pytest.raises(EngineError, match="no glibc libc.so.6 mapped"):
            Engine([s], db_path=tmp_path / "gf.db", pid=p.pid, argv=["t"]).start()
        assert not (tmp_path / "gf.db").exists()
    finally:
        p.kill()
        p.wait()
