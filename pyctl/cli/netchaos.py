"""`gpufault netchaos ...`: delay, loss and partitions between network
namespaces (pyctl/netchaos.py)."""

from __future__ import annotations

import os

import click


@click.group(name="netchaos")
def netchaos_group() -> None:
    """Delay, loss and partitions between two network namespaces (tc, BPF)."""


@netchaos_group.command(name="cleanup")
@click.option("--all", "all_owners", is_flag=True, help="Also namespaces of live owners.")
def netchaos_cleanup(all_owners: bool) -> None:
    """Remove gf* namespaces (and their veths) left by dead processes.

    \b
    Example:
        gpufault netchaos cleanup
    """
    from pyctl import netchaos

    if os.geteuid() != 0:
        raise click.ClickException("netchaos cleanup needs root: run it with sudo")
    for name in netchaos.cleanup(all_owners=all_owners):
        click.echo(f"removed {name}")
