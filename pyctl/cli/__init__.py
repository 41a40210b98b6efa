"""The gpufault command line (click). Thin: every command parses its options,
calls pyctl.api and prints (tests/test_api_layers.py holds it to that).

Layout (docs/cli.md):
  root.py       the `gpufault` group: --db / GPUFAULT_DB (ctx.obj), --debug
  options.py    value types (Duration, Size, Probability, Signal, Code) and
                the option bundles every command shares
  commands.py   COMMANDS: every command and group, registered explicitly
  launch.py     starting a run: RunCommand (options -- CMD), run_specs()
  base.py       UserError, RunFailed, user_errors
  completion.py shell completion of templates, experiments, fault IDs
  man.py        the man page, generated from the command tree
  doctor.py trace.py inject.py show.py demo.py template.py hooks.py
  netchaos.py anchors.py: one module per command or group (tokenizer and
  service keep theirs beside their library: pyctl/cli/tokenizer.py,
  pyctl/cli/service.py)

Errors a user can cause (bad pid, unknown symbol, malformed number, not
root, unsupported kernel) end in one line on stderr and exit status 2.

`cli` is built on first use (PEP 562 __getattr__ below), not when this
package is imported: command modules outside it (pyctl/cli/service.py,
pyctl/cli/tokenizer.py) import pyctl.cli.options, and that import must not
register them while they are still half-imported.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from pyctl.cli.base import RunFailed, UserError, user_errors
from pyctl.cli.launch import run_specs, start_notes

_DEBUG = bool(os.environ.get("GPUFAULT_DEBUG"))


def __getattr__(name: str) -> Any:
    if name in ("cli", "COMMANDS"):
        # lazy: keeps pyctl.cli.commands (+130 modules, ~500 ms) off trace's start, `trace --help`
        from pyctl.cli import commands

        return getattr(commands, name)
    raise AttributeError(f"module 'pyctl.cli' has no attribute {name!r}")


# `trace` and `inject` against a running process: their start-up is the
# time to probes live, so they register alone instead of importing every
# command module (reports, service, experiments: ~0.1-0.2 s). Refs as in
# commands.COMMANDS (tests/test_symbols_store.py checks they are there).
FAST_COMMANDS = {"trace": "pyctl.cli.trace:trace", "inject": "pyctl.cli.inject:inject"}


def _only_run_command(argv: list[str]) -> Any:
    """The root group with only argv's command in it, when that is one of
    FAST_COMMANDS after the root's own options; else None (every command)."""
    # lazy: pyctl.argv (+1 module) only when this runs
    from pyctl.argv import command_of

    ref = FAST_COMMANDS.get(command_of(argv) or "")
    if ref is None:
        return None

    # lazy: keeps pyctl.cli.root (locale, +5 modules) off trace's start
    from pyctl.cli.root import cli as root

    module, attr = ref.split(":")
    root.add_command(getattr(importlib.import_module(module), attr))
    return root


def main(argv: list[str] | None = None) -> None:
    """The `gpufault` entry point: every command group under one error
    contract (pyctl/errors.py): exit 2 and one line for what the user or
    the machine must change, 70 and one line for a bug, 130 for Ctrl-C."""
    # lazy: keeps pyctl.api.errors (+2 modules) off trace's start
    from pyctl.api import errors

    cli = _only_run_command(sys.argv[1:] if argv is None else argv)
    if cli is None:
        # lazy: keeps pyctl.cli.commands (+130 modules, ~500 ms) off trace's start, `trace --help`
        from pyctl.cli.commands import cli

    try:
        rc = cli.main(args=argv, prog_name="gpufault", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("gpufault: interrupted", err=True)
        sys.exit(errors.EXIT_INTERRUPTED)
    except KeyboardInterrupt:
        click.echo("gpufault: interrupted", err=True)
        sys.exit(errors.EXIT_INTERRUPTED)
    except click.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "gpufault"
        click.echo(f"gpufault: {e.format_message().rstrip('.')}: see {where} --help", err=True)
        sys.exit(errors.EXIT_USER)
    except click.ClickException as e:
        click.echo(f"gpufault: {e.format_message()}", err=True)
        # Ours carry their status (RunFailed: 3); click's own say 1: make it 2.
        sys.exit(e.exit_code if isinstance(e, UserError) else errors.EXIT_USER)
    except errors.user_error_types() as e:
        if _DEBUG:
            raise
        click.echo(f"gpufault: {errors.one_line(e)}", err=True)
        sys.exit(errors.EXIT_USER)
    except Exception as e:  # noqa: BLE001 - the one place a bug becomes one line
        # lazy: only on the way out of a command that failed with a bug
        from pyctl.api.errors import damaged_store_line

        said = damaged_store_line(e)
        if said is not None:  # a damaged page met by any reader: the file's fault
            click.echo(f"gpufault: {said}", err=True)
            sys.exit(errors.EXIT_USER)
        if _DEBUG:
            raise
        click.echo(
            f"gpufault: internal error: {type(e).__name__}: {errors.one_line(e)}: "
            "run with --debug for the traceback",
            err=True,
        )
        sys.exit(errors.EXIT_INTERNAL)
    sys.exit(rc if isinstance(rc, int) else 0)


__all__ = ["RunFailed", "UserError", "cli", "main", "run_specs", "start_notes", "user_errors"]
