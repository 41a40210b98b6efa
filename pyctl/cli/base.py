"""What every command module shares: the error classes and the decorator
that turns the library's user-facing exceptions into them.

The error contract itself (exit statuses, one line) is pyctl/errors.py;
pyctl.cli.main applies it to every group.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click


class UserError(click.ClickException):
    """One line on stderr, exit 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"gpufault: {self.format_message()}", err=True)


class RunFailed(UserError):
    """The run started but its evidence could not be written (disk full):
    faults stopped, run marked failed. One line on stderr, exit 3."""

    exit_code = 3


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the library's user-facing exceptions into UserError (so that a
    CliRunner sees exit 2 and one line too, not only pyctl.cli.main); the
    line and its status are the API's (pyctl.api.errors.cli_line)."""

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except Exception as e:
            # lazy: only on the way out of a command that failed
            from pyctl.api.errors import EXIT_RUN_FAILED, cli_line

            said = cli_line(e)
            if said is None:
                raise  # PermissionError, a bug: main's error contract
            status, text = said
            raise (RunFailed if status == EXIT_RUN_FAILED else UserError)(text) from None

    return wrapper


def on_terminal() -> bool:
    """stdout is a terminal: readers cut to 80 columns there, and print
    every value whole into a file or a pipe (faults, show, timeline)."""
    try:
        return sys.stdout.isatty()
    except (OSError, ValueError):
        return False


def open_existing(db_path: str) -> Any:
    """Read-only (SQLite mode=ro): faults/show never create, convert, chmod
    or add tables to the file; a database that is not gpufault's is refused."""
    # lazy: keeps pyctl.api.reading (+1 module) off trace's start and `trace --help`
    from pyctl.api.reading import open_readonly

    try:
        return open_readonly(db_path)
    except ValueError as e:
        raise UserError(str(e)) from None
