"""A session's controller as a child process (IsolatedSession).

Started by pyctl.paths.module_argv (`python -I`, this package by absolute
path, cwd /): nothing of the caller's directory or PYTHONPATH is imported.

Protocol, one JSON object a line:
- stdin, from the parent: {"specs": [FaultSpec.to_json()...], "target":
  Target.to_json(), "settings": Settings.to_json(), "parent": PID}. Then
  stdin stays open: EOF means the parent is gone, and the session disarms.
- stdout, to the parent: {"event": "armed", run_id, mechanism,
  started_at}, {"event": "fire", fault_id, wall, function, tid, action}
  per fire, {"event": "counters", calls, fires, lost, unfinished} once a
  second and at the end, {"event": "notice", text}, {"event": "error",
  type, message} (type: a pyctl.api.errors class name), {"event": "end",
  status, exit_code, ended_at}.
SIGTERM (and SIGINT) disarm; the kernel-side deadline holds if it is
SIGKILLed. Exit status: 0 done, 2 refused (bad input, prerequisite,
target gone), 3 evidence could not be written, 70 internal.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from pyctl.api.errors import EvidenceWriteError, GpufaultError, translate
from pyctl.sigmask import block_sigchld
from pyctl.stopsignals import on_stop_signals

PR_SET_PDEATHSIG = 1


class _Out:
    """JSON lines on the parent's pipe; a parent that stopped reading costs
    us a lost line, never the run (BrokenPipe is swallowed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd = os.dup(1)
        self.broken = False

    def send(self, **msg: Any) -> None:
        if self.broken:
            return
        data = (json.dumps(msg) + "\n").encode()
        with self._lock:
            try:
                os.write(self._fd, data)
            except OSError:
                self.broken = True


def _read_line(fd: int, limit: int = 16 << 20) -> bytes:
    """The request: bytes up to the first newline, read without a buffer
    (what follows on the pipe is nothing but its EOF)."""
    buf = bytearray()
    while b"\n" not in buf and len(buf) < limit:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    return bytes(buf.split(b"\n", 1)[0])


def main() -> int:
    # Die with the parent even before stdin's EOF is read.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    out = _Out()

    # The launcher thread that forked us blocks SIGCHLD, and a mask is
    # inherited: unblock first, so that the "original" mask a started
    # command gets (pyctl/sigmask.py) has SIGCHLD open. Then block it before
    # any thread starts: only the copilot's tracer takes SIGCHLD.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
    block_sigchld()
    # stdout/stderr of the library (warnings, prints) must not mix into the
    # protocol: fd 1 becomes stderr.
    os.dup2(2, 1)
    line = _read_line(0)

    try:
        req = json.loads(line)
        parent = int(req.get("parent") or 0)
        if parent and os.getppid() != parent:
            return 143  # the parent died before the prctl
        # lazy: pyctl.api.faults (ast, copy, +18 modules) only when this runs
        from pyctl.api.faults import spec_from_json

        # lazy: pyctl.api.session (ast, copy, +31 modules, ~100 ms) only when this runs
        from pyctl.api.session import Session, Settings

        # lazy: pyctl.api.target (ast, copy, +15 modules) only when this runs
        from pyctl.api.target import Target

        specs = [spec_from_json(d) for d in req["specs"]]
        target = Target.from_json(req["target"])
        settings = Settings.from_json(req["settings"])
    except (ValueError, KeyError, TypeError) as e:
        out.send(event="error", type="BadInput", message=f"bad request: {e}")
        return 2
    except GpufaultError as e:
        out.send(event="error", type=type(e).__name__, message=str(e))
        return 2

    session = Session(specs, target, settings)
    session.on_fire = lambda f: out.send(
        event="fire", fault_id=f.fault_id, wall=f.wall, function=f.function, tid=f.tid,
        action=f.action,
    )  # fmt: skip

    # SIGTERM and SIGINT disarm, from a thread: a handler that took the
    # session's locks deadlocked on a second SIGTERM (pyctl/stopsignals.py).
    on_stop_signals(lambda: session.disarm(timeout=0), name="gf-child-signal")

    def parent_gone() -> None:
        # The parent holds our stdin open for as long as it lives. Raw
        # reads: a daemon thread blocked in a buffered reader's lock aborts
        # the interpreter at exit ("could not acquire lock ... at shutdown").
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        session.disarm(timeout=0)

    threading.Thread(target=parent_gone, name="gf-child-stdin", daemon=True).start()
    try:
        session.start()
    except GpufaultError as e:
        out.send(event="error", type=type(e).__name__, message=str(e))
        print(f"gpufault: {e}", file=sys.stderr)
        return 2
    except BaseException as e:  # noqa: BLE001
        err = translate(e)
        out.send(event="error", type=type(err).__name__, message=str(err))
        return 70
    out.send(
        event="armed", run_id=session.run_id, mechanism=session.mechanism,
        started_at=session.started_at,
    )  # fmt: skip

    def counters() -> None:
        c = session.counters
        out.send(event="counters", calls=c.calls, fires=c.fires, lost=c.lost,
                 unfinished=c.unfinished)  # fmt: skip

    sent = 0
    while not session.wait(1.0):
        counters()
        for n in session.notices[sent:]:
            out.send(event="notice", text=n)
        sent = len(session.notices)
    for n in session.notices[sent:]:
        out.send(event="notice", text=n)
    counters()
    if session.error is not None:
        out.send(event="error", type=type(session.error).__name__, message=str(session.error))
    # From here a late SIGTERM (the parent's disarm crossing our end) must
    # not turn a finished run into exit -15.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out.send(
        event="end", status=session.status, exit_code=session.exit_code,
        ended_at=session.ended_at or time.time(),
    )  # fmt: skip
    if session.status == "failed":
        return 3 if isinstance(session.error, EvidenceWriteError) else 70
    return 0


if __name__ == "__main__":
    sys.exit(main())
