"""`gpufault anchors`: the kernel module's status, live records, manual fire."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from pyctl.anchors.device import DEFAULT_PATH, AnchorDevice
from pyctl.anchors.record import AnchorRecord
from pyctl.cli.options import Duration, db_option
from pyctl.evidence import store as gf_store
from pyctl.evidence.anchors import store_records

SYS = Path("/sys/module/gpufa")


def _line(r: AnchorRecord) -> str:
    bar0 = " ".join(f"{off:#x}={'-' if v is None else hex(v)}" for off, v in sorted(r.bar0.items()))
    return (
        f"{r.kind:12} {r.fault_id:14} {r.bdf} {r.vendor:04x}:{r.device:04x} "
        f"pid {r.pid} ({r.comm}) code {r.code:#x} bar0 {bar0}"
    )


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
    if not SYS.exists():
        click.echo(
            "gpufa.ko is not loaded: insmod gpufa.ko (see docs/kmod.md); "
            "Xids and process signals/exits are still recorded without it"
        )
        return
    click.echo("gpufa.ko loaded")
    params = SYS / "parameters"
    if params.exists():
        for p in sorted(params.iterdir()):
            try:
                click.echo(f"  {p.name:16} {p.read_text().strip()}")
            except OSError:
                continue
    if os.path.exists(DEFAULT_PATH):
        with AnchorDevice(nonblock=True) as dev:
            for k, v in dev.stats().items():
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
    try:
        dev = AnchorDevice(nonblock=True)
    except OSError as e:
        raise click.ClickException(str(e.strerror or e)) from None
    db = gf_store.open_db(db_path) if db_path else None
    t0 = time.monotonic()
    try:
        while not duration or time.monotonic() - t0 < duration:
            dev.wait(0.2)
            recs = dev.read()
            for r in recs:
                click.echo(_line(r))
            if db is not None and recs:
                store_records(db, recs)
    except KeyboardInterrupt:
        pass
    finally:
        dev.close()


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
        with AnchorDevice() as dev:
            dev.fire(bdf, code)
    except OSError as e:
        raise click.ClickException(f"fire failed: {e.strerror or e}") from None
    click.echo("fired")
