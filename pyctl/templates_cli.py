"""`gpufault template list|show|run`: the fault templates (pyctl/templates)."""

from __future__ import annotations

import click

from pyctl import templates as T


def _split_sets(sets: tuple[str, ...]) -> dict[str, str]:
    from pyctl.cli import UserError

    out = {}
    for s in sets:
        if "=" not in s:
            raise UserError(f"--set {s!r}: use KNOB=VALUE (e.g. --set nth=3)")
        k, v = s.split("=", 1)
        out[k.strip()] = v
    return out


def _get(name: str) -> T.Template:
    from pyctl.cli import UserError

    try:
        return T.get(name)
    except T.TemplateError as e:
        raise UserError(str(e)) from None


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
    from pyctl.cli import UserError

    try:
        ts = T.all_templates()
    except T.TemplateError as e:
        raise UserError(str(e)) from None
    for t in sorted(ts.values(), key=lambda t: (t.klass, t.name)):
        click.echo(f"{t.name:28} v{t.version:<3} class {t.klass}  {t.title}")


@template.command()
@click.argument("name")
@click.option("--set", "sets", multiple=True, metavar="KNOB=VALUE",
              help="show the faults with these knob values")
def show(name: str, sets: tuple[str, ...]) -> None:
    """Show a template: what it does, its knobs, the faults it arms.

    \b
    Example:
      gpufault template show cublas-gemm-exec-failed --set every=11
    """
    from pyctl.cli import UserError

    t = _get(name)
    try:
        specs = t.specs(_split_sets(sets))
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
        click.echo(f"  {k.name:16} {k.default!r:28} {k.help}")
    click.echo("\narms:")
    for s in specs:
        click.echo(f"  {s.describe()}")


# No ignore_unknown_options: an unknown option before `--` is an error, not
# the command to run (`template run X -p 1` once ran `-p`).
@template.command()
@click.argument("name")
@click.option("--set", "sets", multiple=True, metavar="KNOB=VALUE", help="override a knob")
@click.option("-p", "--pid", type=int, help="a running process (all of its threads)")
@click.option("--tid", type=int, help="only this thread (its process is the target)")
@click.option("--db", "db_path", type=click.Path(dir_okay=False), envvar="GPUFAULT_DB",
              default=None, help="evidence database (default: gpufault's)")
@click.option("--duration", default=None, help="stop after this long, e.g. 30s")
@click.option("--copilot-signal", default=None, help="signal the copilot uses (default SIGURG)")
@click.option("--quiet", "-q", is_flag=True, help="no per-fire lines, no status")
@click.option("--xids/--no-xids", default=True, show_default=True,
              help="record NVIDIA Xids and link them to the faults (when the driver's "
                   "tracepoint exists)")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def run(name: str, sets: tuple[str, ...], pid: int | None, tid: int | None,
        db_path: str | None, duration: str | None, copilot_signal: str | None, quiet: bool,
        xids: bool, cmd: tuple[str, ...]) -> None:
    """Arm a template's faults in a process (or a command) until it ends.

    \b
    Examples:
      gpufault template run cuda-oom-sticky --pid 1234
      gpufault template run nccl-rank-stall --pid 2345 --set prob=10% --duration 60s
      gpufault template run cuda-launch-failed --set nth=3 -- ./pyctl/data/doubles/gf-infer
    """
    from pyctl import store
    from pyctl.cli import UserError, _run_engine
    from pyctl.engine import EngineError
    from pyctl.resolve import ResolveError
    from pyctl.spec import SpecError, parse_duration

    t = _get(name)
    db = db_path or str(store.DEFAULT_DB)
    try:
        specs = t.specs(_split_sets(sets))
        dur = parse_duration(duration) if duration else 0.0
    except (T.TemplateError, SpecError) as e:
        raise UserError(str(e)) from None
    try:
        _run_engine(specs, pid, tid, cmd, db, dur, f"template:{t.ident}", copilot_signal, quiet,
                    xids=xids)
    except (T.TemplateError, SpecError, EngineError, ResolveError) as e:
        raise UserError(str(e)) from None
