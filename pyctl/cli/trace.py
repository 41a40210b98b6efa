"""`gpufault trace`: record calls (args, return codes, latency) into the
database, injecting nothing.

It ends with the run's summary (pyctl/calls/summary.py, bcc funccount and
funclatency style): per function the calls, errors by code name, latency
percentiles and a log2 histogram; `gpufault calls RUN` prints the same for
any earlier run, `gpufault calls live` counts in the kernel instead.
"""

from __future__ import annotations

from typing import Any

import click

from pyctl.api.foreground import FaultSpec
from pyctl.cli.base import user_errors
from pyctl.cli.launch import RunCommand, split_run_params, start
from pyctl.cli.options import fault_target_options, no_stack_option, run_options


@click.command(cls=RunCommand)
@fault_target_options
@no_stack_option
@click.option(
    "--entry-only",
    is_flag=True,
    help="record entries only (args, no return/latency): half the probe cost",
)
@click.option(
    "--summary/--no-summary",
    default=True,
    show_default=True,
    help="print the per-function summary (calls, errors, latency) at the end",
)
@click.option("--per-thread", is_flag=True, help="the summary per (function, thread)")
@click.option("--json", "as_json", is_flag=True, help="the summary as JSON on stdout")
@run_options
@user_errors
def trace(summary: bool, per_thread: bool, as_json: bool, **params: Any) -> None:
    """Trace calls: args, return codes, latency, into the database.

    \b
    Examples:
      gpufault trace --pid 1234 --lib libcuda --fn 'cuMemAlloc*' --duration 10s
      gpufault trace --lib libgftarget --fn gf_victim -- ./build/targets/gf_target
    """
    fields, run = split_run_params(params)

    def summarize(eng: Any) -> None:
        # lazy: keeps pyctl.cli.calls (+3 modules) off trace's start and `trace --help`
        from pyctl.cli.calls import print_run_summary

        print_run_summary(
            str(eng.db_path), eng.run_id, per_thread=per_thread, as_json=as_json, budget_s=2.0
        )

    start(
        "trace",
        [FaultSpec.from_fields({**fields, "action": "observe", "trace": True})],
        run,
        on_end=summarize if summary else None,
    )
