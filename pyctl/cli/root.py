"""The root group, `gpufault`: its own options are the ones every command
shares (--db, --debug); the command groups are added by pyctl/cli/__init__.py."""

from __future__ import annotations

import click

from pyctl.api import __version__
from pyctl.api.values import DEFAULT_DB
from pyctl.cli.options import Settings

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    import pyctl.cli as package  # lazy: main() reads the flag there, after the command failed

    package._DEBUG = package._DEBUG or value


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="gpufault")
@click.option(
    "--db",
    "db_path",
    type=click.Path(dir_okay=False),
    envvar="GPUFAULT_DB",
    show_envvar=True,
    default=None,
    help="the evidence database every command reads and writes "
    f"(default {DEFAULT_DB}); a command's own --db wins",
)
@click.option(
    "--debug",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_set_debug,
    help="show the traceback of an internal error (also GPUFAULT_DEBUG=1)",
)
@click.pass_context
def cli(ctx: click.Context, db_path: str | None) -> None:
    """Fault injection and fault forensics for GPU inference stacks.

    \b
    Examples:
      gpufault doctor
      gpufault probes libcuda --pid 1234
      gpufault trace --pid 1234 --lib libcuda --fn 'cuMemAlloc*'
      gpufault inject --pid 1234 --lib libcuda --fn cuMemAlloc_v2 \\
          --action fail --ret CUDA_ERROR_OUT_OF_MEMORY --nth 3
      gpufault faults
      gpufault show 1a2b3c4d-1
      gpufault --db ./run.db faults       # or GPUFAULT_DB=./run.db
    """
    ctx.ensure_object(Settings).db = db_path
