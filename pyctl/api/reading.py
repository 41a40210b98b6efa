"""Reading the evidence as `gpufault faults`, `show` and `timeline` do: the
rows and documents as data, and the text those commands print.

Every reader opens the store read-only (SQLite mode=ro): it never creates,
converts, chmods or adds tables to the file. Errors are BadInput with the
command's one line (no such fault, a run without faults, a damaged page).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pyctl.exceptions import BadInput

# `show RUN` without a limit: a screenful of faults, in words (a sticky
# fault's run holds thousands: 37,167 lines once). As JSON: all of them.
SHOW_RUN_LIMIT = 10
ELLIPSIS = "\u2026"


def open_readonly(db_path: str | os.PathLike[str]) -> Any:
    """The store at db_path, read-only; a file that is not gpufault's, or
    is missing, is BadInput (store.StoreError)."""
    # lazy: pyctl.evidence.store (ctypes, +10 modules) only when this runs
    from pyctl.evidence import store

    return store.open_db(db_path, readonly=True)


@contextlib.contextmanager
def damaged_is_bad_input(db_path: str | os.PathLike[str]) -> Iterator[None]:
    """A page SQLite finds damaged while reading (opening checks the file's
    header, owner and schema, not every page: a full check would cost a
    reader seconds on a large store) is the file's fault, not gpufault's:
    BadInput; a query's own error stays what it is (a bug)."""
    # lazy: sqlite3 (datetime, ~8 ms) off `import gpufault`
    import sqlite3

    # lazy: pyctl.evidence.store (ctypes, +10 modules) only when this runs
    from pyctl.evidence import store

    try:
        yield
    except sqlite3.DatabaseError as e:
        if not store.damaged(e):
            raise
        raise BadInput(f"{db_path}: {e}; restore it from a copy or pass another --db") from None


def fault_list(
    db: Any,
    *,
    run_id: str | None = None,
    function: str | None = None,
    since: float | None = None,
    limit: int = 50,
) -> tuple[list[dict[str, Any]], int]:
    """Fired faults, newest first, at most `limit` (function: a glob;
    since: epoch seconds), and how many more match."""
    # lazy: pyctl.evidence.query (+25 modules, ~100 ms) only when this runs
    from pyctl.evidence import query

    rows = query.faults(db, run_id=run_id, limit=limit, function=function, since=since)
    more = (
        query.count_faults(db, run_id=run_id, function=function, since=since) - len(rows)
        if len(rows) == limit
        else 0
    )
    return rows, more


def fit(text: str, width: int, cut: bool) -> str:
    """text in a column of width: whole when not cut (a file or a pipe gets
    every value in full), else cut with an ellipsis that says it was."""
    if not cut or len(text) <= width:
        return text
    return text[: width - 1] + ELLIPSIS


def render_faults(rows: list[dict[str, Any]], *, cut: bool) -> str:
    """One line a fault: the time of day (local), the library's file name,
    the function, the action, the return value, pid, links. cut: 80
    columns (a terminal), long names cut with an ellipsis; else every
    value in full, the columns as wide as their values."""
    # lazy: pyctl.evidence.words (+24 modules, ~100 ms) only when this runs
    from pyctl.evidence import words

    # On a terminal, one node's faults show the short id (the run's random
    # half, which `show` takes back: query.expand_fault_id), as git shows
    # short hashes; several nodes' (a merged store), a file or a pipe: in full.
    runs = [str(r["fault_id"]).rpartition("-")[0] for r in rows]
    short = cut and len({r[:8] for r in runs}) == 1 and all(len(r) == 16 for r in runs)
    table = []
    for r in rows:
        table.append(
            (
                str(r["fault_id"])[8:] if short else r["fault_id"],
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


@dataclass
class Shown:
    """What `gpufault show` found: one fault's chain, or a run's."""

    docs: list[dict[str, Any]]  # query.fault_chain documents, in fire order
    one: bool  # FAULT_ID or latest (not a run)
    run_id: str | None = None  # the run asked for, if a run
    more: int = 0  # a run's faults past the limit
    ids: list[str] = field(default_factory=list)

    def to_json(self) -> Any:
        """`show --json`: the document, or a run's list of them."""
        return self.docs[0] if self.one else self.docs

    def render(self) -> str:
        """`show`'s text: each chain in words, then how many more."""
        # lazy: pyctl.evidence.query (+25 modules, ~100 ms) only when this runs
        from pyctl.evidence import query

        text = "\n\n".join(query.render_chain(d) for d in self.docs)
        if self.more > 0:
            m, run = self.more, self.run_id
            text += (
                f"\n\n... {m} more fault{'s' if m != 1 else ''} in run {run} "
                f"(--limit {len(self.ids) + m} shows them all; `gpufault faults --run {run}` "
                "lists them one a line)"
            )
        return text


def show(db: Any, what: str, *, limit: int | None = None, db_path: str = "") -> Shown:
    """Everything known about `what`: a fault ID, `latest` (or `last`), or
    a run id (its first `limit` faults, in fire order). db_path only names
    the file in the errors."""
    # lazy: pyctl.evidence.query (+25 modules, ~100 ms) only when this runs
    from pyctl.evidence import query

    ids: list[str] | None = None
    one, more, run = True, 0, None
    try:  # a node's short id (its runs' random half) names its full one
        what = query.expand_fault_id(db, what) if "-" in what else query.expand_run_id(db, what)
    except query.AmbiguousId as e:
        raise BadInput(str(e)) from None
    if what in ("latest", "last"):
        latest = query.latest_fault(db)
        if latest is None:
            raise BadInput(f"no fault recorded in {db_path}: run gpufault inject first")
        ids = [latest]
    elif "-" not in what and (ids := query.run_fault_ids(db, what, limit)) is not None:
        one, run = False, what
        if not ids:
            raise BadInput(
                f"run {what} has no faults: see its calls with `gpufault calls {what}` "
                f"or its events with `gpufault timeline {what}`"
            )
        if limit is not None and len(ids) == limit:
            more = query.count_faults(db, run_id=what) - len(ids)
    else:
        ids = [what]
    docs = []
    for fid in ids:
        doc = query.fault_chain(db, fid)
        if doc is None:
            raise BadInput(f"no fault {fid} in {db_path}: list them with `gpufault faults`")
        docs.append(doc)
    return Shown(docs, one, run, more, ids)


def timeline(db: Any, run: str = "latest") -> Any:
    """A run's (or an experiment's) faults, links, Xids and anchors in time
    order: a pyctl.evidence.timeline document (.to_json(); render_timeline
    for the text). BadInput for a run or experiment that is not there."""
    # lazy: keeps pyctl.evidence.timeline (+25 modules, ~100 ms) off `--help`
    from pyctl.evidence import timeline as tl

    try:
        return tl.build(db, run)
    except tl.TimelineError as e:
        raise BadInput(str(e)) from None


def render_timeline(doc: Any, *, cut: bool = True) -> str:
    """`gpufault timeline`'s text: one line an event; cut: 80 columns (a
    terminal), else every line whole (a file or a pipe)."""
    # lazy: keeps pyctl.evidence.timeline (+25 modules, ~100 ms) off `--help`
    from pyctl.evidence import timeline as tl

    return tl.render(doc, tl.WIDTH if cut else None)


__all__ = [
    "SHOW_RUN_LIMIT",
    "Shown",
    "damaged_is_bad_input",
    "fault_list",
    "fit",
    "open_readonly",
    "render_faults",
    "render_timeline",
    "show",
    "timeline",
]
