"""Shell completion for values click cannot know: template names,
experiment names, fault IDs and return-code names.

Enable it with click's own script (docs/cli.md):

    eval "$(_GPUFAULT_COMPLETE=bash_source gpufault)"    # zsh_source, fish_source

Every function here runs on each TAB: it reads what is on disk (never
writes), and returns no candidates rather than fail: a broken template
file or a database being written must not break the user's shell.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import click
from click.shell_completion import CompletionItem

# Where experiment files live (pyctl/experiment reads them from here too).
EXPERIMENTS_DIR = Path(__file__).resolve().parent.parent / "experiments"


def template_names(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """Every template file's name (GPUFAULT_TEMPLATES first), by file name:
    no template is parsed, so a malformed one still completes."""
    try:
        # lazy: the templates only when the shell completes a template name
        from pyctl.api import templates

        names = templates.names()
    except Exception:  # noqa: BLE001 - completion never fails the shell
        return []
    return [CompletionItem(n) for n in names if n.startswith(incomplete)]


def experiment_names(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """pyctl/experiments/*.toml by name (none while the directory is absent)."""
    try:
        names = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.toml"))
    except OSError:
        return []
    return [CompletionItem(n) for n in names if n.startswith(incomplete)]


def _db_for(ctx: click.Context) -> str:
    """The database the command line names so far: its own --db, the root
    group's, GPUFAULT_DB, else the default path."""
    c: click.Context | None = ctx
    while c is not None:
        given = c.params.get("db_path")
        if given:
            return str(given)
        c = c.parent
    # lazy: pyctl.api.values (+1 module) only when this runs
    from pyctl.api.values import DEFAULT_DB

    return os.environ.get("GPUFAULT_DB") or str(DEFAULT_DB)


def fault_ids(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The newest fault IDs in the database, read-only (SQLite mode=ro: the
    file is never created, converted or locked for writing)."""
    path = _db_for(ctx)
    if not os.path.isfile(path):
        return []
    try:
        uri = f"file:{Path(path).absolute()}?mode=ro"
        with sqlite3.connect(uri, uri=True, timeout=0.2) as conn:
            rows = conn.execute(
                "SELECT fault_id, function FROM faults WHERE fault_id LIKE ? "
                "ORDER BY wall DESC LIMIT 50",
                (incomplete.replace("%", "") + "%",),
            ).fetchall()
    except Exception:  # noqa: BLE001 - no table, locked, not SQLite: no candidates
        return []
    return [CompletionItem(str(fid), help=str(fn)) for fid, fn in rows]


def code_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Return-code names of the catalog library --lib names (CUDA's when
    --lib is not given yet)."""
    # lazy: pyctl.api.values (+1 module) only when this runs
    from pyctl.api.values import code_names as names_of

    names = names_of(str(ctx.params.get("lib") or "cuda"))  # no catalog: no candidates
    low = incomplete.lower()  # catalogs spell names their way (ncclInternalError)
    return [CompletionItem(n) for n in names if n.lower().startswith(low)]
