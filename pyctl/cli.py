"""The gpufault command line (click). Thin: every command calls the library."""

from __future__ import annotations

import click

from pyctl import __version__


@click.group()
@click.version_option(__version__, prog_name="gpufault")
def cli() -> None:
    """Fault injection and fault forensics for GPU inference stacks."""
