"""Chaos Toolkit probes: what a run's faults did, read from the evidence
store (what `gpufault faults` and `gpufault show` read).

run_id defaults to the last run this process armed (an action's output
cannot be passed to a later activity in an experiment file), db to that
run's database. `at_least` with `timeout` waits for fires first: a fault
fires on the target's next matching call, which a probe run right after
the action may precede.
"""

from __future__ import annotations

from typing import Any

from pyctl import api
from pyctl import chaostoolkit as reg
from pyctl.api.errors import BadInput, translate
from pyctl.chaostoolkit.actions import DEFAULT_DB, _duration, _target


def _run(run_id: str | None, db: str | None) -> tuple[str, str, Any]:
    """(run id, db, the session if this process armed it)."""
    s = reg.session(run_id)
    rid = run_id or (s.run_id if s is not None else "")
    path = db or (s.db if s is not None else "")
    if not rid:
        raise BadInput("give run_id: this process armed no fault (an action's output has it)")
    if not path:
        raise BadInput(f"give db: run {rid} was not armed by this process")
    return rid, path, s


def _wait(s: Any, at_least: int, timeout: float) -> None:
    if s is not None and at_least > 0 and timeout > 0:
        s.wait_fires(at_least, timeout=timeout)


def _records(run_id: str | None, db: str | None, at_least: int, timeout: float) -> list[Any]:
    # lazy: pyctl.api.evidence (ast, copy, +16 modules, ~100 ms) only when this runs
    from pyctl.api.evidence import Evidence

    rid, path, s = _run(run_id, db)
    _wait(s, at_least, timeout)
    with Evidence(path) as ev:
        ev.run(rid)  # an unknown run is an error, not zero fires
        return ev.faults(rid)


def fires(
    run_id: str | None = None, db: str | None = None, at_least: int = 0, timeout: float = 0.0
) -> int:
    """How many faults the run fired (rows in the store)."""
    try:
        return len(_records(run_id, db, at_least, timeout))
    except Exception as e:  # noqa: BLE001 - the journal's one line
        raise reg.fail(e) from e


def faults(
    run_id: str | None = None, db: str | None = None, at_least: int = 0, timeout: float = 0.0
) -> list[dict[str, Any]]:
    """The run's faults in fire order: fault_id (for `gpufault show`),
    function, action, retval (what was injected), ret (what the caller
    saw), tid, wall (Unix time)."""
    try:
        return [
            {"fault_id": f.fault_id, "function": f.function, "action": f.action,
             "retval": f.retval, "ret": f.ret, "tid": f.tid, "wall": f.wall}
            for f in _records(run_id, db, at_least, timeout)
        ]  # fmt: skip
    except Exception as e:  # noqa: BLE001
        raise reg.fail(e) from e


def trace_summary(
    run_id: str | None = None,
    db: str | None = None,
    pid: int | str | None = None,
    lib: str | None = None,
    fn: str | list[str] | None = None,
    duration: float | str | None = None,
    per_thread: bool = False,
    entry_only: bool = False,
) -> dict[str, Any]:
    """Per function: calls, errors by code name, latency percentiles and a
    histogram (pyctl.calls.summary.Summary.to_json()). With pid, lib, fn and
    duration: trace those calls now, for that long (in a child controller,
    as the actions run), then summarize; else summarize a recorded run's
    calls (run_id, default the last this process armed)."""
    # lazy: pyctl.calls.summary (ast, copy, +34 modules, ~300 ms) only when this runs
    from pyctl.calls import summary

    # lazy: pyctl.evidence.store (ast, copy, +27 modules, ~200 ms) only when this runs
    from pyctl.evidence import store

    try:
        if lib or fn or pid is not None:
            if not (lib and fn and pid is not None and duration is not None):
                raise BadInput("trace_summary: a trace needs pid, lib, fn and duration together")
            path = db or DEFAULT_DB
            secs = _duration(duration)
            spec = api.Fault.trace(lib, fn, entry_only=entry_only)
            tgt = _target(pid, None)
            s = api.arm(spec, tgt, db=path, duration=secs, isolate=True, kind="trace")
            reg.register(s)
            s.wait(secs + 30)  # the deadline is the kernel's; the child's end follows it
            s.disarm()
            if s.error is not None:
                raise s.error
            rid = s.run_id
        else:
            rid, path, _s = _run(run_id, db)
        try:
            d = store.open_db(path, readonly=True)
            try:
                return summary.from_calls(d, rid, per_thread=per_thread).to_json()
            finally:
                d.close()
        except Exception as e:  # noqa: BLE001 - StoreError, SummaryError: one line
            raise translate(e) from e
    except Exception as e:  # noqa: BLE001
        raise reg.fail(e) from e


__all__ = ["fires", "faults", "trace_summary"]
