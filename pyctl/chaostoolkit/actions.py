"""Chaos Toolkit actions: arm a fault for a duration, disarm it.

Every action's keywords are the `gpufault inject` options (Python
spelling: nth, every, after, max, prob, window, when, caller, sticky ...):
they go through the same spec builder as the command line, so a value
means the same in an experiment's JSON as in a shell. Each returns once
every probe is attached, with what the journal should keep:

    {"run_id": "aa5622b5", "mechanism": "copilot", "db": "...", "pid": 1234,
     "duration": 30.0, "kind": "inject", "specs": ["fail ret=-5 ..."],
     "started_at": 1796184629.6}
"""

from __future__ import annotations

import os
from typing import Any

from pyctl import api
from pyctl import chaostoolkit as reg
from pyctl.api.errors import BadInput

DEFAULT_DB = "/var/lib/gpufault/gpufault.db"  # = evidence.store.DEFAULT_DB, not imported


def _duration(value: float | str) -> float:
    """Seconds, or "30s", "2m": never 0, a chaos fault always has its end."""
    # lazy: pyctl.spec (ast, copy, +19 modules, ~100 ms) only when this runs
    from pyctl.spec import SpecError, parse_duration

    hint = 'a chaos fault ends at its kernel-side deadline: give e.g. 30 or "30s"'
    try:
        secs = parse_duration(value, "duration", allow_zero=True)
    except SpecError as e:
        raise BadInput(f"{e}; {hint}") from e
    if secs <= 0:
        raise BadInput(f"duration: {value!r} is no time: {hint}")
    return secs


def _target(pid: int | str | None, tid: int | str | None) -> Any:
    # lazy: pyctl.api.target (ast, copy, +16 modules) only when this runs
    from pyctl.api.target import Target

    def number(v: int | str, what: str) -> int:
        # Chaos Toolkit substitutes "${pid}" into a string.
        try:
            return int(v)
        except (TypeError, ValueError):
            raise BadInput(f"{what}: {v!r} is not a process id: give a number") from None

    if (pid is None) == (tid is None):
        raise BadInput("give pid (the process to fault) or tid (one of its threads)")
    if pid is not None:
        return Target.process(number(pid, "pid"))
    return Target.thread(number(tid, "tid"))  # type: ignore[arg-type]


def _arm(specs: list[Any], target: Any, duration: float, db: str, kind: str,
         arm_timeout: float) -> dict[str, Any]:  # fmt: skip
    # isolate=True: the library forks the child from its own long-lived
    # launcher thread, so Chaos Toolkit's short-lived pool threads cannot
    # take the child's PR_SET_PDEATHSIG with them.
    s = api.arm(
        specs, target, db=db, duration=duration, isolate=True, kind=kind,
        arm_timeout=arm_timeout,
    )  # fmt: skip
    reg.register(s)
    return {
        "run_id": s.run_id,
        "mechanism": s.mechanism,
        "db": os.path.abspath(db),
        "pid": target.pid,
        "tid": target.tid,
        "duration": duration,
        "kind": kind,
        "specs": [sp.describe() for sp in specs],
        "started_at": s.started_at,
    }


def inject(
    lib: str,
    fn: str | list[str],
    pid: int | str | None = None,
    action: str = "fail",
    duration: float | str = 30.0,
    db: str = DEFAULT_DB,
    tid: int | str | None = None,
    arm_timeout: float = 120.0,
    **options: Any,
) -> dict[str, Any]:
    """Arm `action` (fail, stall, signal, corrupt, observe) on `fn` in
    `lib` in process `pid` for `duration` (seconds, or "30s"); options are
    the action's and trigger's (ret, mode, stall, signal, corrupt, nth,
    every, after, max, prob, window, when, caller, sticky ...)."""
    # lazy: pyctl.api.faults (ast, copy, +23 modules, ~100 ms) only when this runs
    from pyctl.api.faults import Fault

    try:
        spec = Fault.from_fields({"lib": lib, "fn": fn, "action": action, **options})
        return _arm([spec], _target(pid, tid), _duration(duration), db, "inject", arm_timeout)
    except Exception as e:  # noqa: BLE001 - GpufaultError and the unexpected: the journal's
        raise reg.fail(e) from e


def stall(
    lib: str,
    fn: str | list[str],
    stall: str | float,
    pid: int | str | None = None,
    duration: float | str = 30.0,
    db: str = DEFAULT_DB,
    **options: Any,
) -> dict[str, Any]:
    """Hold each matching call's thread for `stall` ("5ms", "2s") at entry."""
    if isinstance(stall, (int, float)) and not isinstance(stall, bool):
        stall = f"{float(stall) * 1000:g}ms"  # a number is seconds, as Fault.stall takes it
    return inject(lib, fn, pid, "stall", duration, db, stall=stall, **options)


def corrupt(
    lib: str,
    fn: str | list[str],
    corrupt: str,
    pid: int | str | None = None,
    duration: float | str = 30.0,
    db: str = DEFAULT_DB,
    **options: Any,
) -> dict[str, Any]:
    """Corrupt an argument or what the call wrote ("arg1:zero",
    "arg1+8:flip:0x1"; docs/cli.md --corrupt)."""
    return inject(lib, fn, pid, "corrupt", duration, db, corrupt=corrupt, **options)


def template_run(
    name: str,
    pid: int | str | None = None,
    duration: float | str = 30.0,
    db: str = DEFAULT_DB,
    knobs: dict[str, Any] | None = None,
    tid: int | str | None = None,
    arm_timeout: float = 120.0,
) -> dict[str, Any]:
    """A shipped template's faults (`gpufault template list`), its knobs
    set from `knobs` ({"lib": "libcuda", "after": 0})."""
    # lazy: pyctl.api.faults (ast, copy, +23 modules, ~100 ms) only when this runs
    from pyctl.api.faults import template

    try:
        ident, specs = template(name, **(knobs or {}))
        out = _arm(specs, _target(pid, tid), _duration(duration), db, f"template:{ident}",
                   arm_timeout)  # fmt: skip
    except Exception as e:  # noqa: BLE001
        raise reg.fail(e) from e
    out["template"] = ident
    return out


def disarm(run_id: str | None = None) -> dict[str, Any]:
    """Disarm one run (run_id) or every run this process armed: the rollback.
    A run that ended by its deadline is disarmed already (it is listed too)."""
    if run_id:
        s = reg.session(run_id)
        if s is None:
            known = ", ".join(x.run_id for x in reg.sessions()) or "none"
            raise reg.fail(BadInput(f"disarm: no run {run_id} armed by this process ({known})"))
        s.disarm()
        done = [s.run_id]
    else:
        done = reg.disarm_all()
    status = {}
    for rid in done:
        s = reg.session(rid)
        status[rid] = {"status": s.status, "fires": s.fires} if s is not None else {}
    return {"disarmed": done, "runs": status}


__all__ = ["inject", "stall", "corrupt", "template_run", "disarm"]
