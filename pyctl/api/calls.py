"""Call summaries from Python, as `gpufault calls` prints them: a recorded
run's (its per-call rows) and a live one (counted in the kernel, no event
per call). Each is a pyctl.calls.summary.Summary: .functions, .to_json(),
.render()."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from pyctl.exceptions import GpufaultError


class SummaryTooSlow(GpufaultError):
    """A run's summary did not finish within its budget; the text says how
    to get it later."""


def run_summary(
    db: str | os.PathLike[str],
    run_id: str = "last",
    *,
    per_thread: bool = False,
    budget_s: float | None = None,
) -> Any:
    """The summary of a recorded run (a run id or 'last'), from the store
    at db, opened read-only. budget_s: give up after about this long
    (SQLite scans ~3 s per million rows here) with SummaryTooSlow: a trace
    that recorded millions of calls must still end when told to. Raises
    BadInput (store.StoreError, summary.SummaryError) for a store or run
    that is not there."""
    # lazy: sqlite3 (datetime, ~8 ms) off `import gpufault`
    import sqlite3

    # lazy: pyctl.calls.summary (ast, copy, +33 modules, ~100 ms) only when this runs
    from pyctl.calls import summary

    # lazy: pyctl.evidence.store (ast, copy, +21 modules, ~100 ms) only when this runs
    from pyctl.evidence import store

    conn = store.open_db(db, readonly=True)
    if budget_s is not None:
        end = time.monotonic() + budget_s
        conn.conn.set_progress_handler(lambda: int(time.monotonic() > end), 10_000)
    try:
        return summary.from_calls(conn, run_id, per_thread=per_thread)
    except sqlite3.OperationalError as e:
        if budget_s is None or "interrupted" not in str(e):
            raise
        raise SummaryTooSlow(
            f"the summary of run {run_id} takes longer than {budget_s:g} s: "
            f"run `gpufault calls {run_id} --db {db}` for it"
        ) from None
    finally:
        conn.close()


def live(
    pid: int,
    lib: str,
    fn: Sequence[str],
    *,
    duration: float = 0.0,
    latency: bool = True,
    per_thread: bool = False,
    on_start: Callable[[Any], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> Any:
    """Count the calls of `fn` (names or globs, each must match) in `lib`
    in the running process `pid`, in BPF maps, for `duration` seconds (0:
    until SIGINT/SIGTERM or the process's end), and summarize them. As
    the command does, it handles SIGINT and SIGTERM for the count (the
    handlers before are put back): call it from the main thread.
    latency=False counts entries only (no return probe). on_start gets the
    pyctl.calls.aggregate.Aggregator once its probes are live (.sites).
    Nothing is stored; the probes are detached on every exit. Raises
    AggregateError or MissingPrerequisite (BpfError)."""
    # lazy: pyctl.calls.aggregate (ast, copy, +41 modules, ~100 ms) only when this runs
    from pyctl.calls import aggregate

    agg = aggregate.Aggregator(pid, lib, tuple(fn), latency=latency, per_thread=per_thread)
    return aggregate.run(agg, duration, on_start=on_start, on_notice=on_notice or (lambda m: None))


__all__ = ["SummaryTooSlow", "live", "run_summary"]
