"""SIGTERM twice to an isolated session's child, back to back (an
experiment's abort and its end each send one): the child disarms and exits
within its grace, its run row closed, every time. Before
pyctl/stopsignals.py the handler called Event.set() and, when the second
signal landed inside the first handler's lock, the child deadlocked with
itself until the runner SIGKILLed it (worker-hang-abort, 1 run in 4)."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from conftest import requires_root
from gftarget import LIB, Target

import gpufault
from gpufault import Fault


@requires_root
def test_two_sigterms_in_a_row_end_the_child_and_close_its_run(tmp_path: Path) -> None:
    t = Target()
    try:
        for i in range(24):
            db = tmp_path / f"gf{i}.db"
            s = gpufault.arm(Fault.hang(str(LIB), "gf_victim", nth=1), t.pid, db=db,
                             duration=60, isolate=True)  # fmt: skip
            p = s.proc
            assert p is not None and t.p.stdin is not None
            t.p.stdin.write("victim 1 1\n")  # its one call held by the hang
            t.p.stdin.flush()
            assert s.wait_fires(1, timeout=10)
            # The second one at another moment each round: it has to land
            # while the first handler runs (1 run in 4 of the experiment).
            os.kill(p.pid, signal.SIGTERM)
            time.sleep(i * 0.0002)  # the gap is the test's variable, not a sync
            os.kill(p.pid, signal.SIGTERM)
            t0 = time.monotonic()
            rc = p.wait(10)
            took = time.monotonic() - t0
            assert rc in (0, -15, 143), rc
            assert took < 5, took
            status = sqlite3.connect(db).execute("SELECT status FROM runs").fetchone()[0]
            assert status == "done", (i, status)
            s.disarm()
            assert t.p.stdout is not None
            while (ln := t.p.stdout.readline().strip()) != "done":  # the held call returned
                assert ln, "the target ended"
    finally:
        t.close()


def test_the_handler_takes_no_lock_the_main_thread_may_hold() -> None:
    """A main thread that spends its time inside an Event's lock, and 200
    signals: stop() runs once, on its own thread, and the process exits."""
    code = (
        "import os, signal, sys, threading\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
        "from pyctl.stopsignals import on_stop_signals\n"
        "ev = threading.Event(); n = []\n"
        "on_stop_signals(lambda: (n.append(1), ev.set()))\n"
        "print('ready', flush=True)\n"
        "while not ev.is_set():\n"
        "    ev.wait(0.0001)\n"
        "print('stopped', len(n), flush=True)\n"
    )
    p = subprocess.Popen([sys.executable, "-I", "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    for _ in range(200):
        p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=10)
    assert p.returncode == 0 and out == "stopped 1\n", (p.returncode, out)
