"""`gpufault faults` and `gpufault show`: read the evidence database
(read-only, pyctl/query.py renders)."""

from __future__ import annotations

import json

import click

from pyctl.cli.base import UserError, open_existing, user_errors
from pyctl.cli.completion import fault_ids
from pyctl.cli.options import db_option, json_option


@click.command()
@db_option()
@click.option("--run", "run_id", default=None, help="only this run")
@click.option("--limit", default=50, show_default=True, help="at most this many faults")
@json_option
def faults(db_path: str, run_id: str | None, limit: int, as_json: bool) -> None:
    """List fired faults, newest first.

    \b
    Example:
      gpufault faults --limit 10
    """
    from pyctl import query

    db = open_existing(db_path)
    rows = query.faults(db, run_id=run_id, limit=limit)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no faults recorded")
        return
    click.echo(f"{'FAULT':14} {'FUNCTION':24} {'ACTION':8} {'RET':>6} {'PID':>7} {'TID':>7} LINKS")
    for r in rows:
        ret = "" if r["ret"] is None else str(r["ret"])
        click.echo(
            f"{r['fault_id']:14} {r['function'][:24]:24} {r['action']:8} {ret:>6} "
            f"{r['pid']:>7} {r['tid']:>7} {r['links']}"
        )


@click.command()
@click.argument("fault_id", shell_complete=fault_ids)
@db_option()
@json_option
@user_errors
def show(fault_id: str, db_path: str, as_json: bool) -> None:
    """Everything known about one fault: call, registers, stack, what followed.

    \b
    Example:
      gpufault show 1a2b3c4d-1
    """
    from pyctl import query

    db = open_existing(db_path)
    doc = query.fault_chain(db, fault_id)
    if doc is None:
        raise UserError(f"no fault {fault_id} in {db_path}: list them with `gpufault faults`")
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(query.render_chain(doc))
