"""`gpufault anchors`: the kernel module's status, live records, manual fire
(pyctl/api/anchors.py)."""

from __future__ import annotations

from typing import Any

import click

from pyctl.api import anchors as A
from pyctl.api.errors import GpufaultError
from pyctl.cli.options import Duration, db_option


@click.group(invoke_without_command=True)
@click.pass_context
def anchors(ctx: click.Context) -> None:
    """Kernel anchors (gpufa.ko): status, live records, manual fire.

    \b
    Examples:
      gpufault anchors                  # module status and watched devices
      gpufault anchors watch --db /var/lib/gpufault/gpufault.db
      gpufault anchors fire --bdf 0000:01:00.0
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(status)


@anchors.command()
def status() -> None:
    """Is the module loaded, with which parameters, and its counters.

    \b
    Example:
      gpufault anchors status
    """
    st = A.status()
    if not st.loaded:
        click.echo(
            "gpufa.ko is not loaded: insmod gpufa.ko (see docs/kmod.md); "
            "Xids and process signals/exits are still recorded without it"
        )
        return
    click.echo("gpufa.ko loaded")
    for k, v in [*st.params.items(), *st.stats.items()]:
        click.echo(f"  {k:16} {v}")


@anchors.command()
@db_option(default=False)
@click.option(
    "--duration",
    type=Duration(allow_zero=True),
    default=0.0,
    help="stop after this long, e.g. 60s, 1m30s (0 or none: at Ctrl-C)",
)
def watch(db_path: str | None, duration: float) -> None:
    """Print (and store) anchor records as they arrive.

    \b
    Example:
      gpufault anchors watch --duration 60
    """

    def show(recs: list[Any]) -> None:
        for r in recs:
            click.echo(A.record_line(r))

    try:
        A.watch(show, db=db_path, duration=duration)
    except GpufaultError as e:
        raise click.ClickException(str(e)) from None


@anchors.command()
@click.option("--bdf", default=None, help="a watched device (default: the first)")
@click.option("--code", default=0, type=int, help="a code stored in the record")
def fire(bdf: str | None, code: int) -> None:
    """Fire a manual anchor (QA): snapshot a watched device now.

    \b
    Example:
      gpufault anchors fire --bdf 0000:01:00.0
    """
    try:
        A.fire(bdf, code)
    except GpufaultError as e:
        raise click.ClickException(str(e)) from None
    click.echo("fired")
