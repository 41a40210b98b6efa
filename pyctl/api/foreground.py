"""A session in the calling thread, as the command line runs one.

`gpufault inject`, `trace` and `template run` arm through here: the same
engine, runner and evidence as arm(), but on the main thread with the
command line's signal handling (SIGINT/SIGTERM end the run cleanly from
before it starts until its row is closed, SIGUSR1 releases held threads)
and the library's own exceptions left as they are, for the CLI's error
contract (pyctl/errors.py) to print. Light on purpose: importing it loads
nothing but the runner, so `trace --pid` start-up pays for no more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pyctl.run_options import DEFAULT_MAX_DB_BYTES, RunOptions
from pyctl.sigmask import block_sigchld
from pyctl.spec import FaultSpec


def run_foreground(
    specs: list[FaultSpec],
    options: RunOptions,
    *,
    pid: int | None = None,
    tid: int | None = None,
    cmd: Sequence[str] = (),
    on_start: Callable[[Any], None] | None = None,
    on_fire: Callable[[dict[str, Any]], None] | None = None,
    on_xid: Callable[[Any], None] | None = None,
) -> tuple[int, Any]:
    """Arm `specs` in the target until it ends, Ctrl-C, SIGTERM or the
    options' duration; returns (a started command's status or 0, the
    engine, whose stats and run id the caller reports). The caller blocks
    SIGCHLD in its main thread before any thread starts (block_sigchld,
    here too), as the copilot needs."""
    # lazy: pyctl.runner (difflib, mmap, +46 modules, ~200 ms) only when this runs
    from pyctl.runner import Target, run

    return run(
        specs,
        Target(pid=pid, tid=tid, cmd=tuple(cmd)),
        options,
        on_start=on_start,
        on_fire=on_fire,
        on_xid=on_xid,
    )


__all__ = ["DEFAULT_MAX_DB_BYTES", "FaultSpec", "RunOptions", "block_sigchld", "run_foreground"]
