"""Python frames of a CPython thread (issue 22), pyctl/symbols/pystack.py.

- The 3.11/3.12 offset tables equal tools/pyoffsets.c's offsetof output,
  compiled against each installed interpreter's own internal headers.
- The location-table decoder gives every instruction the line CPython's
  own co_positions gives it.
- Each installed CPython (pyenv's 3.11, 3.12, 3.13; 3.10 refused in one
  line) blocked in nested functions on a non-main thread reads back as
  that thread's own traceback.extract_stack says, frame by frame.
- Root: a CPython 3.11 target (the host python3, -I) whose worker thread
  calls os.getpid (libc getpid) from nested functions is stalled there by
  `gpufault inject`; while the copilot holds the thread, `py-spy dump
  --nonblocking` reads the same process, and the fault's stored Python
  frames equal py-spy's for that thread (function, line), and `show` says
  they were read while the thread was held.
"""

from __future__ import annotations

import dis
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procio import start_ready

from pyctl.symbols import pystack

REPO = Path(__file__).resolve().parent.parent
PYENV = Path("/root/.pyenv/versions")
GF = [sys.executable, "-m", "pyctl"]
TIMEOUT = 60.0

CHILD = """\
import os, sys, threading, traceback
class Model:
    def forward(self):
        return layer()
def layer():
    st = traceback.extract_stack()
    print(repr([(f.name, f.lineno) for f in reversed(st)]), threading.get_native_id(), flush=True)
    os.read(0, 1)
def handler():
    return Model().forward()
t = threading.Thread(target=handler, name="gf-worker")
t.start()
t.join()
"""
BLOCK_LINE = 8  # os.read(0, 1): where the thread is when it is read


def _pythons() -> list[Path]:
    """The host's python3 (every machine has it: a fresh one has no pyenv),
    then each pyenv version where one is installed."""
    found = sorted(PYENV.glob("3.1[0-9].*/bin/python3")) if PYENV.is_dir() else []
    return [Path(sys.executable), *found]


def _minor(exe: Path) -> tuple[int, int]:
    major, minor = exe.parent.parent.name.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("exe", [p for p in _pythons() if _minor(p) in pystack.OFFSETS], ids=str)
def test_offsets_equal_the_headers(exe: Path, tmp_path: Path) -> None:
    cc = shutil.which("cc")
    m = _minor(exe)
    inc = exe.parent.parent / "include" / f"python{m[0]}.{m[1]}"
    if cc is None or not (inc / "internal" / "pycore_frame.h").exists():
        pytest.skip("no C compiler or no internal headers")
    out = tmp_path / "off"
    subprocess.run([cc, f"-I{inc}", f"-I{inc}/internal", str(REPO / "tools" / "pyoffsets.c"),
                    "-o", str(out)], check=True, capture_output=True)  # fmt: skip
    got = dict(ln.split() for ln in subprocess.check_output([out], text=True).splitlines())
    assert {k: int(v) for k, v in got.items()} == pystack.OFFSETS[m]


def _sample() -> None:
    x = 0
    for i in range(3):
        if i % 2:
            x += i
        else:
            x -= 1
    try:
        x = x // 0
    except ZeroDivisionError:
        x = -1
    print(x)


def test_line_table_equals_co_positions() -> None:
    if sys.version_info[:2] < (3, 11):
        pytest.skip("3.11+ location tables")
    for code in (_sample.__code__, dis.dis.__code__, pystack.line_of.__code__):
        positions = list(code.co_positions())
        assert positions
        for unit, (line, *_cols) in enumerate(positions):
            got = pystack.line_of(code.co_linetable, code.co_firstlineno, unit)
            assert got == line, (code.co_name, unit)


@pytest.mark.parametrize("exe", _pythons(), ids=str)
def test_read_equals_the_threads_own_traceback(exe: Path, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    p = subprocess.Popen([str(exe), "-I", str(script)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdin is not None
        own, tid = p.stdout.readline().rsplit(" ", 1)
        # The worker printed before os.read: wait until it is in the read.
        _wait(lambda: _wchan(p.pid, int(tid)) != "0" and _state(p.pid, int(tid)) == "S")
        st = pystack.read(p.pid, int(tid))
        if _minor(exe) not in pystack.OFFSETS and _minor(exe) != (3, 13):
            assert st is not None and not st.frames
            assert st.error.startswith(f"python frames: unsupported CPython 3.{_minor(exe)[1]}")
            return
        assert st is not None and st.error == "", st
        assert st.version.startswith(f"3.{_minor(exe)[1]}.")
        want = eval(own)  # noqa: S307 - the child's own repr of its stack
        want[0] = (want[0][0], BLOCK_LINE)
        got = [(f.function.rsplit(".", 1)[-1], f.line) for f in st.frames]
        # The thread's bootstrap frames (threading.py) follow handler.
        assert got[: len(want)] == want, (got, want)
        assert st.frames[1].function == "Model.forward"
        assert all(f.file.endswith("threading.py") for f in st.frames[len(want) :])
        # Where the eval loop was entered from C: the thread's bootstrap
        # (thread_run), and in 3.11 Thread.run's call of the target too
        # (CALL_FUNCTION_EX, inlined from 3.12 on).
        assert st.frames[-1].entry
        assert [f.entry for f in st.frames[:2]] == [False, False]
        if _minor(exe) == (3, 11):
            assert st.frames[2].entry
        # Not a thread Python knows: no stack, not an error.
        assert pystack.read(p.pid, 1) is None
    finally:
        p.kill()
        p.wait()


def test_not_python_is_none() -> None:
    p = subprocess.Popen(["/bin/sleep", "30"])
    try:
        r = pystack.Reader(p.pid)
        assert r.not_python and r.thread(p.pid) is None
        r.close()
    finally:
        p.kill()
        p.wait()


def _state(pid: int, tid: int) -> str:
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def _wchan(pid: int, tid: int) -> str:
    return Path(f"/proc/{pid}/task/{tid}/wchan").read_text()


def _wait(cond, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + TIMEOUT
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)  # polling a state that only the kernel reports


# ---- root: against py-spy on the same held thread --------------------------------

TARGET = """\
import os, sys, threading
class Model:
    def forward(self, n):
        return self.layer(n)
    def layer(self, n):
        return os.getpid() + n
def handler(n):
    return Model().forward(n)
def loop():
    print(threading.get_native_id(), flush=True)
    sys.stdin.readline()  # gpufault is attached
    n = 0
    while True:
        n = handler(n) & 1
t = threading.Thread(target=loop, name="gf-worker")
t.start()
t.join()
"""


def _pyspy(pid: int, tid: int, pyspy: str) -> list[tuple[str, int]]:
    """py-spy's frames of tid (innermost first): `dump --json`."""
    r = subprocess.run([pyspy, "dump", "--pid", str(pid), "--nonblocking", "--json"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    for t in json.loads(r.stdout):
        if t.get("os_thread_id") == tid:
            return [(f["name"], f["line"]) for f in t["frames"]]
    raise AssertionError(f"py-spy has no thread {tid}: {r.stdout[:500]}")


@pytest.mark.root
def test_frames_equal_py_spys_while_held(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("requires root (BPF, ptrace)")
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        pytest.skip("py-spy missing (pip install py-spy: a dev dependency)")
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the host python3 is the 3.11 target")
    script, db = tmp_path / "target.py", tmp_path / "gf.db"
    script.write_text(TARGET)
    tgt = subprocess.Popen([sys.executable, "-I", str(script)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    gf = None
    try:
        assert tgt.stdout is not None and tgt.stdin is not None
        tid = int(tgt.stdout.readline())
        gf, _ = start_ready(
            [*GF, "inject", "--pid", str(tgt.pid), "--lib", "libc", "--fn", "getpid",
             "--action", "stall", "--stall", "60s", "--nth", "1", "--duration", "120s",
             "--db", str(db),
             "--mechanism", "copilot"],  # the copilot's stop holds the thread
        )  # fmt: skip
        tgt.stdin.write("go\n")
        tgt.stdin.flush()
        _wait(lambda: _state(tgt.pid, tid) == "t", "the copilot's stop")
        want = _pyspy(tgt.pid, tid, pyspy)
        # The fault's row (with its Python frames) while the thread is held.
        _wait(lambda: _fault(db) is not None, "the fault row")
        assert _state(tgt.pid, tid) == "t"
    finally:
        if gf is not None:
            gf.send_signal(signal.SIGINT)
            gf.wait(timeout=120)
        tgt.kill()
        tgt.wait()
    fid = _fault(db)
    assert fid is not None
    with sqlite3.connect(db) as c:
        got = c.execute("SELECT function, line, file FROM pyframes WHERE fault_id=? "
                        "ORDER BY depth", (fid,)).fetchall()  # fmt: skip
    # py-spy names 3.11+ frames by co_qualname too.
    assert [(f, ln) for f, ln, _ in got] == want
    assert [f for f, _, _ in got[:3]] == ["Model.layer", "Model.forward", "handler"]
    assert got[0][2] == str(script)
    show = subprocess.run([*GF, "show", fid, "--db", str(db)], capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    assert "python stack (CPython 3.11." in show.stdout
    assert "read while the copilot held the thread" in show.stdout, show.stdout
    # Joined to the native stack under each _PyEval_EvalFrameDefault frame,
    # as py-spy dump --native shows them: the first eval-loop frame (the
    # innermost) runs Model.layer.
    lines = show.stdout.splitlines()
    ev = next(i for i, ln in enumerate(lines) if "!_PyEval_EvalFrameDefault+" in ln)
    assert lines[ev + 1].strip() == f"py#0  Model.layer ({script}:6)", show.stdout
    assert "(Python frames under the eval loop's)" in show.stdout


def _fault(db: Path) -> str | None:
    if not db.exists():
        return None
    try:
        with sqlite3.connect(db) as c:
            row = c.execute("SELECT fault_id FROM faults LIMIT 1").fetchone()
    except sqlite3.OperationalError:
        return None
    return row[0] if row else None


FAIL_TARGET = """\
import os, sys, threading
class Model:
    def forward(self):
        return self.layer()
    def layer(self):
        return os.getpid()
def after_fault():
    print("failed", flush=True)
    sys.stdin.readline()  # where the thread is once let go
def loop():
    print(threading.get_native_id(), flush=True)
    sys.stdin.readline()  # gpufault is attached
    while Model().forward():
        pass
    after_fault()
t = threading.Thread(target=loop, name="gf-worker")
t.start()
t.join()
"""


@pytest.mark.root
def test_a_copilot_fail_keeps_the_frames_of_the_fault(tmp_path: Path) -> None:
    """A fail is let go within microseconds, long before its fire is
    ingested: the frames are the ones the copilot read while it held the
    thread (Model.layer), not where the thread went next (after_fault)."""
    if os.geteuid() != 0:
        pytest.skip("requires root (BPF, ptrace)")
    script, db = tmp_path / "target.py", tmp_path / "gf.db"
    script.write_text(FAIL_TARGET)
    tgt = subprocess.Popen([sys.executable, "-I", str(script)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    gf = None
    try:
        assert tgt.stdout is not None and tgt.stdin is not None
        tid = int(tgt.stdout.readline())
        gf, _ = start_ready(
            [*GF, "inject", "--pid", str(tgt.pid), "--lib", "libc", "--fn", "getpid",
             "--action", "fail", "--ret", "0", "--nth", "1", "--duration", "120s",
             "--db", str(db),
             "--mechanism", "copilot"],  # the copilot's stop holds the thread
        )  # fmt: skip
        tgt.stdin.write("go\n")
        tgt.stdin.flush()
        assert tgt.stdout.readline().strip() == "failed"  # getpid returned 0: injected
        _wait(lambda: _state(tgt.pid, tid) == "S", "the thread's read after the fault")
        _wait(lambda: _fault(db) is not None, "the fault row")
    finally:
        if gf is not None:
            gf.send_signal(signal.SIGINT)
            gf.wait(timeout=120)
        tgt.kill()
        tgt.wait()
    fid = _fault(db)
    with sqlite3.connect(db) as c:
        got = c.execute("SELECT function, line FROM pyframes WHERE fault_id=? ORDER BY depth",
                        (fid,)).fetchall()  # fmt: skip
    assert got[:3] == [("Model.layer", 6), ("Model.forward", 4), ("loop", 13)], got
    show = subprocess.run([*GF, "show", str(fid), "--db", str(db)], capture_output=True, text=True)
    assert "read while the copilot held the thread" in show.stdout, show.stdout


@pytest.mark.root
def test_a_command_that_exits_after_its_fault_keeps_its_python_frames(tmp_path: Path) -> None:
    """A command (exec'd after the copilot seized its first image, a shell)
    that exits right after its fault: the frames were read while the
    copilot held the thread, by a reader made for the new executable."""
    if os.geteuid() != 0:
        pytest.skip("requires root (BPF, ptrace)")
    script, db = tmp_path / "cmd.py", tmp_path / "gf.db"
    script.write_text(
        "import os\ndef layer():\n    return os.getpid()\n"
        "def forward():\n    return layer()\nfor _ in range(5):\n    forward()\n"
    )
    r = subprocess.run(
        [*GF, "inject", "--lib", "libc", "--fn", "getpid", "--action", "fail", "--ret", "7",
         "--after", "2", "--max", "1", "--db", str(db), "--", sys.executable, "-I", str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    fid = _fault(db)
    with sqlite3.connect(db) as c:
        got = c.execute("SELECT function, line FROM pyframes WHERE fault_id=? ORDER BY depth",
                        (fid,)).fetchall()  # fmt: skip
        (outcome,) = c.execute("SELECT outcome FROM faults WHERE fault_id=?", (fid,)).fetchone()
    assert got == [("layer", 3), ("forward", 5), ("<module>", 7)], (got, outcome)
    show = subprocess.run([*GF, "show", str(fid), "--db", str(db)], capture_output=True, text=True)
    assert "read while the copilot held the thread" in show.stdout, show.stdout
