"""gpufault as a Chaos Toolkit extension (docs/api.md, "Chaos Toolkit").

Actions (module pyctl.chaostoolkit.actions): inject, stall, corrupt,
template_run arm faults into a process for a duration and return at once
with {run_id, mechanism, db, ...} (into the journal); disarm is the
rollback (one run, or every run this process armed). Probes (module
pyctl.chaostoolkit.probes): fires, faults, trace_summary read the
evidence back.

    "method": [{
      "type": "action", "name": "gpu-oom",
      "provider": {"type": "python", "module": "pyctl.chaostoolkit.actions",
                   "func": "inject",
                   "arguments": {"pid": "${service_pid}", "lib": "libcuda",
                                 "fn": "cuMemAlloc_v2", "ret": "CUDA_ERROR_OUT_OF_MEMORY",
                                 "sticky": true, "duration": 30,
                                 "db": "/var/lib/gpufault/gpufault.db"}}}],
    "rollbacks": [{"type": "action", "name": "disarm",
                   "provider": {"type": "python",
                                "module": "pyctl.chaostoolkit.actions", "func": "disarm"}}]

Every fault runs in a child controller (gpufault.arm(isolate=True)): the
chaos process goes on with its probes and pauses while the fault lives,
and the fault's kernel-side deadline is the action's duration, so it ends
on time even if this process is killed. The sessions are kept here (one
registry for the process: chaos runs every activity in one interpreter)
and disarmed at interpreter exit as well, whatever the rollback strategy.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

_LOCK = threading.Lock()
_SESSIONS: dict[str, Any] = {}  # run id -> gpufault.IsolatedSession, in arm order


def register(session: Any) -> None:
    with _LOCK:
        _SESSIONS[session.run_id] = session


def session(run_id: str | None) -> Any | None:
    """The session of run_id armed by this process; None given: the last one."""
    with _LOCK:
        if run_id:
            return _SESSIONS.get(run_id)
        return next(reversed(_SESSIONS.values()), None)


def sessions() -> list[Any]:
    with _LOCK:
        return list(_SESSIONS.values())


def disarm_all() -> list[str]:
    """Disarm every session this process armed (newest first); their run IDs."""
    done = []
    for s in reversed(sessions()):
        try:
            s.disarm()
        except Exception:  # noqa: BLE001 - disarm the others first
            pass
        done.append(s.run_id)
    return done


atexit.register(disarm_all)


def fail(e: BaseException) -> BaseException:
    """A gpufault error as Chaos Toolkit's ActivityFailed (the journal then
    shows gpufault's one line), where chaoslib is importable."""
    try:
        # lazy: chaoslib is there only when Chaos Toolkit runs this extension
        from chaoslib.exceptions import ActivityFailed
    except ImportError:
        return e
    err = ActivityFailed(f"gpufault: {e}")
    err.__cause__ = e
    return err


__all__ = ["register", "session", "sessions", "disarm_all", "fail"]
