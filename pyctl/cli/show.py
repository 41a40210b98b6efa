"""`gpufault faults` and `gpufault show`: read the evidence database
(read-only, pyctl/query.py renders)."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterator
from typing import Any

import click

from pyctl.cli.base import UserError, open_existing, user_errors
from pyctl.cli.completion import fault_ids
from pyctl.cli.options import SINCE, db_option, json_option


@contextlib.contextmanager
def damaged_is_one_line(db_path: str) -> Iterator[None]:
    """A page SQLite finds damaged while reading (open_existing checks the
    file's header, owner and schema, not every page: a full check would
    cost a reader seconds on a large store) is the file's fault, not
    gpufault's: one line and exit 2, not an internal error."""
    try:
        yield
    except sqlite3.DatabaseError as e:
        raise UserError(f"{db_path}: {e}; restore it from a copy or pass another --db") from None


@click.command()
@db_option()
@click.option("--run", "run_id", default=None, help="only this run")
@click.option(
    "--function", "function", default=None, help="only functions matching this glob (cuMem*)"
)
@click.option("--since", type=SINCE, default=None, help="fired since: 10m, 2h ago, or an ISO time")
@click.option("--limit", default=50, show_default=True, help="at most this many faults")
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
    from pyctl import query

    db = open_existing(db_path)
    with damaged_is_one_line(db_path):
        rows = query.faults(db, run_id=run_id, limit=limit, function=function, since=since)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no faults recorded" + (" that match" if run_id or function or since else ""))
        return
    click.echo(render_faults(rows))


def render_faults(rows: list[dict[str, Any]]) -> str:
    """One line a fault, 80 columns: the time of day (local), the library's
    file name, the function, the action, the return value, pid, links."""
    from pyctl import words

    fw = max(12, *(len(r["fault_id"]) for r in rows))
    out = [
        f"{'FAULT':{fw}} {'TIME':8} {'LIBRARY':12} {'FUNCTION':17} {'ACTION':7} "
        f"{'RET':>5} {'PID':>7} LINKS"
    ]
    for r in rows:
        ret = "" if r["ret"] is None else str(r["ret"])
        lib = os.path.basename(r["library"] or "-")
        pid = "-" if r["pid"] is None else str(r["pid"])  # a layer's fault may have none
        out.append(
            f"{r['fault_id']:{fw}} {words.wall_time(r['wall'], '%H:%M:%S'):8} {lib[:12]:12} "
            f"{(r['function'] or '-')[:17]:17} {r['action'] or '-':7} {ret:>5} {pid:>7} "
            f"{r['links']}"
        )
    return "\n".join(out)


@click.command()
@click.argument("fault_id", metavar="FAULT_ID|RUN|latest", shell_complete=fault_ids)
@db_option()
@json_option
@user_errors
def show(fault_id: str, db_path: str, as_json: bool) -> None:
    """Everything known about a fault: call, registers, stack, what followed.

    FAULT_ID is one fault; `latest` the newest one; a run id every fault
    of that run, in fire order (--json: a list).

    \b
    Examples:
      gpufault show 1a2b3c4d-1
      gpufault show latest
      gpufault show 1a2b3c4d
    """

    db = open_existing(db_path)
    with damaged_is_one_line(db_path):
        _show(db, fault_id, db_path, as_json)


def _show(db: Any, fault_id: str, db_path: str, as_json: bool) -> None:
    from pyctl import query

    ids: list[str] | None = None
    one = True
    if fault_id in ("latest", "last"):
        latest = query.latest_fault(db)
        if latest is None:
            raise UserError(f"no fault recorded in {db_path}: run gpufault inject first")
        ids = [latest]
    elif "-" not in fault_id and (ids := query.run_fault_ids(db, fault_id)) is not None:
        one = False
        if not ids:
            raise UserError(
                f"run {fault_id} has no faults: see its calls with `gpufault calls {fault_id}` "
                f"or its events with `gpufault timeline {fault_id}`"
            )
    else:
        ids = [fault_id]
    docs = []
    for fid in ids:
        doc = query.fault_chain(db, fid)
        if doc is None:
            raise UserError(f"no fault {fid} in {db_path}: list them with `gpufault faults`")
        docs.append(doc)
    if as_json:
        click.echo(json.dumps(docs[0] if one else docs, indent=2))
    else:
        click.echo("\n\n".join(query.render_chain(d) for d in docs))
