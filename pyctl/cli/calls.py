"""`gpufault calls`: per-function call summaries (counts, errors by code
name, latency percentiles, log2 histograms).

    gpufault calls RUN          a recorded run's per-call rows (RUN: id or `last`)
    gpufault calls live ...     in-kernel counts on a running process, no event per call

Plan (the lead's): `gpufault trace` ends with `print_run_summary()`, and
later makes the in-kernel mode (`calls live`) its default, with `--calls`
asking for the per-call events (rows in the store) it records today.

Registered by the CLI owner: one line in pyctl/cli/commands.py,
"pyctl.cli.calls:calls". Uses the CLI's value types and --db
(pyctl/cli/options.py), as pyctl/cli/tokenizer.py does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from pyctl.cli.base import UserError  # one line on stderr, exit 2
from pyctl.cli.options import DURATION, db_option
from pyctl.evidence import store


def _output_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--json", "as_json", is_flag=True, help="machine-readable output")(fn)
    fn = click.option("--per-thread", is_flag=True, help="one summary per (function, thread)")(fn)
    return fn


def print_run_summary(
    db_path: str,
    run_id: str,
    *,
    per_thread: bool = False,
    as_json: bool = False,
    budget_s: float | None = None,
) -> None:
    """Print the summary of a recorded run (run_id or 'last') on stdout: what
    `gpufault trace` prints when it ends. Opens the database read-only.
    budget_s: give up after about this long (SQLite scans ~3 s per million
    rows here), saying so and how to get it later: a trace that recorded
    millions of calls must still end when told to.
    Raises store.StoreError or summary.SummaryError (one-line messages)."""
    import sqlite3
    import time

    from pyctl.calls import summary

    db = store.open_db(db_path, readonly=True)
    if budget_s is not None:
        end = time.monotonic() + budget_s
        db.conn.set_progress_handler(lambda: int(time.monotonic() > end), 10_000)
    try:
        s = summary.from_calls(db, run_id, per_thread=per_thread)
    except sqlite3.OperationalError as e:
        if budget_s is None or "interrupted" not in str(e):
            raise
        click.echo(
            f"gpufault: the summary of run {run_id} takes longer than {budget_s:g} s: "
            f"run `gpufault calls {run_id} --db {db_path}` for it",
            err=True,
        )
        return
    finally:
        db.close()
    click.echo(json.dumps(s.to_json(), indent=2) if as_json else s.render())


class CallsGroup(click.Group):
    """`calls RUN` reads as `calls show RUN`; a bare `calls` as `calls show last`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("-h", "--help")):
            args = ["show", *args]
        return super().parse_args(ctx, args)


@click.group("calls", cls=CallsGroup)
def calls() -> None:
    """Per-function call summaries: counts, errors, latency histograms.

    `calls RUN` summarizes a recorded run (`trace`'s per-call rows);
    `calls live` counts in the kernel on a running process, with no event
    per call (cheap enough to leave on).

    \b
    Examples:
      gpufault calls last
      gpufault calls 1a2b3c4d --per-thread --json
      gpufault calls live --pid 1234 --lib libcuda --fn 'cuMemAlloc*' --duration 5s
    """


@calls.command("show")
@click.argument("run", default="last")
@db_option()  # its own --db, else `gpufault --db`, else GPUFAULT_DB
@_output_options
def show(run: str, db_path: str, per_thread: bool, as_json: bool) -> None:
    """Summarize a recorded run: RUN is a run id or `last` (the default).

    \b
    Examples:
      gpufault calls last
      gpufault calls 1a2b3c4d --per-thread
      gpufault calls last --json --db /tmp/gf.db
    """
    from pyctl.calls.summary import SummaryError

    try:
        print_run_summary(db_path, run, per_thread=per_thread, as_json=as_json)
    except (store.StoreError, SummaryError) as e:
        raise UserError(str(e)) from None


@calls.command("live")
@click.option("-p", "--pid", type=int, required=True, help="a running process")
@click.option("--lib", required=True, help="library: soname/name (libcuda, cuda), path, or glob")
@click.option(
    "--fn",
    "fn_pattern",
    required=True,
    multiple=True,
    help="function name or glob (cuMemAlloc*); repeat for several, each must match",
)
@click.option(
    "--duration", type=DURATION, default=None, help="stop after this long (5s, 1m); default Ctrl-C"
)
@click.option(
    "--latency/--count-only",
    default=True,
    show_default=True,
    help="latency and errors need a return probe; --count-only counts entries (cheapest)",
)
@_output_options
def live(
    pid: int,
    lib: str,
    fn_pattern: tuple[str, ...],
    duration: float | None,
    latency: bool,
    per_thread: bool,
    as_json: bool,
) -> None:
    """Count calls in the kernel (BPF maps, no event per call), then summarize.

    Nothing is written to the database; probes are detached on every exit
    (--duration, Ctrl-C, the target's exit, an error).

    \b
    Examples:
      gpufault calls live --pid 1234 --lib libcuda --fn 'cuMemAlloc*' --duration 5s
      gpufault calls live --pid 1234 --lib libnccl --fn 'nccl*' --count-only
      gpufault calls live --pid 1234 --lib tokenizers --fn tok:hf-encode --per-thread
    """
    from pyctl.bpf.libbpf import BpfError
    from pyctl.calls import aggregate

    agg = aggregate.Aggregator(pid, lib, fn_pattern, latency=latency, per_thread=per_thread)

    def started(a: aggregate.Aggregator) -> None:
        n = len(a.sites)
        what = "counts, latency, errors" if latency else "counts only"
        until = f"for {duration:g}s" if duration else "... Ctrl-C to end"
        click.echo(
            f"Counting {n} function{'s' if n != 1 else ''} of {a.sites[0].lib.display} "
            f"in pid {pid} ({what}, in kernel) {until}",
            err=True,
        )

    try:
        s = aggregate.run(
            agg, duration or 0.0, on_start=started, on_notice=lambda m: click.echo(m, err=True)
        )
    except (aggregate.AggregateError, BpfError) as e:
        from pyctl.errors import one_line

        raise UserError(one_line(e)) from None
    click.echo(json.dumps(s.to_json(), indent=2) if as_json else s.render())
