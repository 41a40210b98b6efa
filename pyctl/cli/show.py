"""`gpufault faults` and `gpufault show`: read the evidence database
(read-only; pyctl/api/reading.py reads and renders)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import click

from pyctl.api import reading
from pyctl.api.errors import BadInput
from pyctl.cli.base import UserError, on_terminal, open_existing, user_errors
from pyctl.cli.completion import fault_ids
from pyctl.cli.options import SINCE, db_option, json_option


@contextlib.contextmanager
def damaged_is_one_line(db_path: str) -> Iterator[None]:
    """A damaged page is the file's fault, not gpufault's: one line and
    exit 2, not an internal error (pyctl.api.reading.damaged_is_bad_input)."""
    try:
        with reading.damaged_is_bad_input(db_path):
            yield
    except BadInput as e:
        raise UserError(str(e)) from None


@click.command()
@db_option()
@click.option("--run", "run_id", default=None, help="only this run")
@click.option(
    "--function", "function", default=None, help="only functions matching this glob (cuMem*)"
)
@click.option("--since", type=SINCE, default=None, help="fired since: 10m, 2h ago, or an ISO time")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="at most this many faults (a last line says how many more match)",
)
@json_option
def faults(
    db_path: str,
    run_id: str | None,
    function: str | None,
    since: float | None,
    limit: int,
    as_json: bool,
) -> None:
    """List fired faults, newest first.

    \b
    Examples:
      gpufault faults --limit 10
      gpufault faults --function 'cuMem*' --since 10m
      gpufault faults --run 1a2b3c4d --since 2026-12-01T11:00
    """
    db = open_existing(db_path)
    with damaged_is_one_line(db_path):
        rows, more = reading.fault_list(
            db, run_id=run_id, function=function, since=since, limit=limit
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no faults recorded" + (" that match" if run_id or function or since else ""))
        return
    click.echo(render_faults(rows))
    if more > 0:
        # Said, not silently cut: the table stopped at --limit.
        click.echo(f"... {more} more (--limit {limit + more} lists them all)")


_on_terminal = on_terminal  # the readers' one rule (pyctl/cli/base.py)


def render_faults(rows: list[dict[str, Any]], *, cut: bool | None = None) -> str:
    """The faults table (pyctl.api.reading.render_faults): on a terminal
    (cut=None: stdout is one) 80 columns, elsewhere every value in full."""
    return reading.render_faults(rows, cut=_on_terminal() if cut is None else cut)


SHOW_RUN_LIMIT = reading.SHOW_RUN_LIMIT  # `show RUN` without --limit (--json: all)


@click.command()
@click.argument("fault_id", metavar="FAULT_ID|RUN|latest", shell_complete=fault_ids)
@db_option()
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help=f"RUN: at most this many faults, the first ones (default {SHOW_RUN_LIMIT}; "
    "--json: all); a last line says how many more",
)
@json_option
@user_errors
def show(fault_id: str, db_path: str, limit: int | None, as_json: bool) -> None:
    """Everything known about a fault: call, registers, stack, what followed.

    FAULT_ID is one fault; `latest` the newest one; a run id the faults
    of that run, in fire order (--json: a list), --limit of them.

    \b
    Examples:
      gpufault show 1a2b3c4d-1
      gpufault show latest
      gpufault show 1a2b3c4d
    """

    db = open_existing(db_path)
    with damaged_is_one_line(db_path):
        _show(db, fault_id, db_path, as_json, limit)


def _show(db: Any, fault_id: str, db_path: str, as_json: bool, limit: int | None) -> None:
    if limit is None and not as_json:
        limit = SHOW_RUN_LIMIT
    shown = reading.show(db, fault_id, limit=limit, db_path=db_path)
    click.echo(json.dumps(shown.to_json(), indent=2) if as_json else shown.render())
