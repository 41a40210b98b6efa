"""A whole trace from Python: its summary as data. (Experiments, a layer
above the session API, have theirs in pyctl/experiment/public.py.)"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pyctl.api.errors import BadInput
from pyctl.api.faults import Fault, Fn
from pyctl.api.session import arm
from pyctl.api.target import Target


def trace(
    target: Target | int | Sequence[str],
    lib: str,
    fn: Fn,
    *,
    db: str | os.PathLike[str],
    duration: float = 0.0,
    entry_only: bool = False,
    per_thread: bool = False,
) -> Any:
    """Record every call of `fn` in `lib` for `duration` seconds (or until
    a started command ends) and return the run's pyctl.calls.summary.Summary:
    per function the calls, errors by code name, latency percentiles and
    a log2 histogram (.to_json() for plain data, .render() for the text
    `gpufault trace` prints)."""
    tgt = Target.of(target)
    if not duration and not tgt.command:
        raise BadInput("trace: give duration= (seconds) for a running process, or a command")
    s = arm(Fault.trace(lib, fn, entry_only=entry_only), tgt, db=db, duration=duration,
            kind="trace")  # fmt: skip
    try:
        s.wait()
    finally:
        s.disarm()
    if s.error is not None:
        raise s.error
    return s.summary(per_thread=per_thread)


__all__ = ["trace"]
