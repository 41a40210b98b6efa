"""`gpufault faults` and `gpufault show`: read the evidence database
(read-only, pyctl/evidence/query.py renders)."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
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
    from pyctl.evidence import store

    try:
        yield
    except sqlite3.DatabaseError as e:
        if not store.damaged(e):
            raise  # a query's own error is gpufault's: the internal-error path
        raise UserError(f"{db_path}: {e}; restore it from a copy or pass another --db") from None


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
    from pyctl.evidence import query

    db = open_existing(db_path)
    with damaged_is_one_line(db_path):
        rows = query.faults(db, run_id=run_id, limit=limit, function=function, since=since)
        more = (
            query.count_faults(db, run_id=run_id, function=function, since=since) - len(rows)
            if len(rows) == limit
            else 0
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


ELLIPSIS = "\u2026"


def _on_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (OSError, ValueError):
        return False


def fit(text: str, width: int, cut: bool) -> str:
    """text in a column of width: whole when not cut (a file or a pipe gets
    every value in full), else cut with an ellipsis that says it was."""
    if not cut or len(text) <= width:
        return text
    return text[: width - 1] + ELLIPSIS


def render_faults(rows: list[dict[str, Any]], *, cut: bool | None = None) -> str:
    """One line a fault: the time of day (local), the library's file name,
    the function, the action, the return value, pid, links. On a terminal
    (cut=None: stdout is one) 80 columns, long names cut with an ellipsis;
    elsewhere every value in full, the columns as wide as their values."""
    from pyctl.evidence import words

    if cut is None:
        cut = _on_terminal()
    table = []
    for r in rows:
        table.append(
            (
                r["fault_id"],
                words.wall_time(r["wall"], "%H:%M:%S"),
                os.path.basename(r["library"] or "-"),
                r["function"] or "-",
                r["action"] or "-",
                "" if r["ret"] is None else str(r["ret"]),
                "-" if r["pid"] is None else str(r["pid"]),  # a layer's fault may have none
                str(r["links"]),
            )
        )
    head = ("FAULT", "TIME", "LIBRARY", "FUNCTION", "ACTION", "RET", "PID", "LINKS")
    # 80 columns on a terminal; elsewhere wide enough for the widest value.
    widths = [max(12, *(len(t[0]) for t in table)), 8, 12, 17, 7, 5, 7, 0]
    if not cut:
        widths = [max(w, len(h), *(len(t[i]) for t in table)) for i, (w, h) in
                  enumerate(zip(widths, head, strict=True))]  # fmt: skip
    right = {5, 6}  # RET, PID
    names = {2, 3, 4}  # LIBRARY, FUNCTION, ACTION: cut on a terminal; ids and numbers never

    def line(cells: tuple[str, ...]) -> str:
        out = []
        for i, (c, w) in enumerate(zip(cells, widths, strict=True)):
            if i == len(cells) - 1:
                out.append(c)
            elif i in right:
                out.append(f"{c:>{w}}")
            else:
                out.append(f"{fit(c, w, cut and i in names):{w}}")
        return " ".join(out).rstrip()

    return "\n".join([line(head), *(line(t) for t in table)])


# `show RUN` without --limit: a screenful of faults, in words (a sticky
# fault's run holds thousands: 37,167 lines once). --json: all of them.
SHOW_RUN_LIMIT = 10


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
    from pyctl.evidence import query

    ids: list[str] | None = None
    one = True
    more = 0
    if limit is None and not as_json:
        limit = SHOW_RUN_LIMIT
    if fault_id in ("latest", "last"):
        latest = query.latest_fault(db)
        if latest is None:
            raise UserError(f"no fault recorded in {db_path}: run gpufault inject first")
        ids = [latest]
    elif "-" not in fault_id and (ids := query.run_fault_ids(db, fault_id, limit)) is not None:
        one = False
        if not ids:
            raise UserError(
                f"run {fault_id} has no faults: see its calls with `gpufault calls {fault_id}` "
                f"or its events with `gpufault timeline {fault_id}`"
            )
        if limit is not None and len(ids) == limit:
            more = query.count_faults(db, run_id=fault_id) - len(ids)
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
        return
    click.echo("\n\n".join(query.render_chain(d) for d in docs))
    if more > 0:
        click.echo(
            f"\n... {more} more fault{'s' if more != 1 else ''} in run {fault_id} "
            f"(--limit {len(ids) + more} shows them all; `gpufault faults --run {fault_id}` "
            "lists them one a line)"
        )
