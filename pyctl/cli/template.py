"""`gpufault template list|show|run`: the fault templates (pyctl/templates)."""

from __future__ import annotations

from typing import Any

import click

from pyctl.api import templates as T
from pyctl.cli import launch as L
from pyctl.cli.base import UserError, user_errors
from pyctl.cli.completion import template_names
from pyctl.cli.options import (
    copilot_signal_option,
    db_option,
    duration_option,
    mechanism_option,
    metrics_addr_option,
    quiet_option,
    ready_fd_option,
    set_option,
    target_options,
    xids_option,
)


def _get(name: str) -> T.Template:
    try:
        return T.get(name)
    except T.TemplateError as e:
        raise UserError(str(e)) from None


name_argument = click.argument("name", shell_complete=template_names)


@click.group("template")
def template() -> None:
    """Named, versioned fault templates (classes 1-3, 6-8).

    \b
    Examples:
      gpufault template list
      gpufault template show cuda-oom-sticky
      gpufault template run cuda-oom-sticky --pid 1234 --set after=5 --duration 30s
    """


@template.command("list")
def list_() -> None:
    """List templates: name, version, class, title.

    \b
    Example:
      gpufault template list
    """
    try:
        ts = T.all_templates()
    except T.TemplateError as e:
        raise UserError(str(e)) from None
    for t in sorted(ts.values(), key=lambda t: (t.klass, t.name)):
        click.echo(f"{t.name:28} v{t.version:<3} class {t.klass}  {t.title}")


@template.command()
@name_argument
@set_option("show the knobs and faults with these values")
def show(name: str, sets: dict[str, str]) -> None:
    """Show a template: what it does, its knobs, the faults it arms.

    With --set, each knob shows the value the run will use (typed as its
    default), and the faults are expanded with them.

    \b
    Example:
      gpufault template show cublas-gemm-exec-failed --set every=11
    """
    t = _get(name)
    overrides = sets
    try:
        values = t.values(overrides)
        specs = t.specs(overrides)
    except T.TemplateError as e:
        raise UserError(str(e)) from None
    click.echo(f"{t.ident}  (class {t.klass})  {t.path}")
    click.echo(t.title)
    click.echo("")
    click.echo(t.description)
    if t.watch:
        click.echo(f"\nwatch: {t.watch}")
    click.echo("\nknobs (--set KNOB=VALUE):")
    for k in t.knobs.values():
        if k.name in overrides:
            # The value it will use, then where it came from and what it replaces.
            shown = f"{values[k.name]!r} (--set; default {k.default!r})"
        else:
            shown = repr(k.default)
        click.echo(f"  {k.name:16} {shown:28} {k.help}")
    click.echo("\narms:")
    for s in specs:
        click.echo(f"  {s.describe()}")


# No ignore_unknown_options: an unknown option before `--` is an error, not
# the command to run (`template run X -p 1` once ran `-p`).
@template.command()
@name_argument
@set_option("override a knob")
@target_options
@db_option()
@duration_option(help="stop after this long, e.g. 30s, 1m30s")
@copilot_signal_option
@mechanism_option
@quiet_option
@ready_fd_option
@xids_option
@metrics_addr_option
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
@user_errors
def run(name: str, sets: dict[str, str], **params: Any) -> None:
    """Arm a template's faults in a process (or a command) until it ends.

    \b
    Examples:
      gpufault template run cuda-oom-sticky --pid 1234
      gpufault template run nccl-rank-stall --pid 2345 --set prob=10% --duration 60s
      gpufault template run cuda-launch-failed --set nth=3 -- ./pyctl/data/doubles/gf-infer
    """
    t = _get(name)
    try:
        specs = t.specs(sets)
    except T.TemplateError as e:
        raise UserError(str(e)) from None
    # Through the module: a test replaces L.run_specs to see what a run gets.
    L.start(f"template:{t.ident}", specs, params)
