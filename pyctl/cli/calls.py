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

from pyctl.api.errors import BadInput, GpufaultError, one_line
from pyctl.cli.base import UserError  # one line on stderr, exit 2
from pyctl.cli.options import DURATION, db_option


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
    Raises BadInput (store.StoreError, summary.SummaryError: one-line
    messages); pyctl.api.calls.run_summary reads it."""
    # lazy: keeps pyctl.api.calls (+1 module) off `--help`
    from pyctl.api.calls import SummaryTooSlow, run_summary

    try:
        s = run_summary(db_path, run_id, per_thread=per_thread, budget_s=budget_s)
    except SummaryTooSlow as e:
        click.echo(f"gpufault: {e}", err=True)
        return
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
    try:
        print_run_summary(db_path, run, per_thread=per_thread, as_json=as_json)
    except BadInput as e:
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
    # lazy: keeps pyctl.api.calls (+1 module) off `--help`
    from pyctl.api import calls as api_calls

    def started(a: Any) -> None:
        n = len(a.sites)
        what = "counts, latency, errors" if latency else "counts only"
        until = f"for {duration:g}s" if duration else "... Ctrl-C to end"
        click.echo(
            f"Counting {n} function{'s' if n != 1 else ''} of {a.sites[0].lib.display} "
            f"in pid {pid} ({what}, in kernel) {until}",
            err=True,
        )

    try:
        s = api_calls.live(pid, lib, fn_pattern, duration=duration or 0.0, latency=latency,
                           per_thread=per_thread, on_start=started,
                           on_notice=lambda m: click.echo(m, err=True))  # fmt: skip
    except GpufaultError as e:  # AggregateError, BpfError: the hint too
        raise UserError(one_line(e)) from None
    click.echo(json.dumps(s.to_json(), indent=2) if as_json else s.render())
