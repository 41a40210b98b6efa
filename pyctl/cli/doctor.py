"""`gpufault doctor` (what this host allows) and `gpufault probes` (where a
probe can go): the checks before a run, made by pyctl/api/doctor.py and
pyctl/api/probes.py; this module prints them."""

from __future__ import annotations

import json
import sys

import click

from pyctl.api.errors import MissingPrerequisite
from pyctl.cli.base import UserError, user_errors
from pyctl.cli.options import json_option


def mark(ok: bool, required: bool, tty: bool | None = None) -> str:
    """ok / FAIL / WARN (a failing check the requested work does not need),
    highlighted only on a terminal: piped or captured output stays plain."""
    text, color = ("ok  ", None) if ok else ("FAIL", "red") if required else ("WARN", "yellow")
    if tty is None:
        tty = sys.stdout.isatty()
    return click.style(text, fg=color, bold=True) if color and tty else text


@click.command()
@json_option
@click.option(
    "--for",
    "features",
    multiple=True,
    type=click.Choice(["trace", "inject", "xids", "tokenizer-count", "all"]),
    help="the work to check for (repeatable; default: trace and inject)",
)
def doctor(as_json: bool, features: tuple[str, ...]) -> None:
    """What this kernel and host allow, each with a fix.

    Exits 1 when a check that the requested work needs fails (FAIL); a
    failing check it does not need is a WARN.

    \b
    Examples:
      gpufault doctor
      gpufault doctor --for xids --json
    """
    # lazy: keeps pyctl.api.doctor (+1 module) off `--help`
    from pyctl.api import doctor as dr

    rep = dr.report(features)
    if as_json:
        click.echo(json.dumps(rep.to_json(), indent=2))
    else:
        for c in rep.checks:
            click.echo(f"{mark(c.ok, rep.required(c))} {c.name:22} {c.detail}")
            if not c.ok and c.fix:
                click.echo(f"     {'':22} fix: {c.fix}")
        if not rep.ok:
            click.echo(f"gpufault: {rep.failure_line()}", err=True)
    if not rep.ok:
        sys.exit(1)


@click.command()
@click.argument("lib", required=False)
@click.option("-p", "--pid", type=int, help="resolve LIB in this process")
@click.option(
    "--fn", "fn_pattern", multiple=True, help="glob over function names (repeatable; default *)"
)
@json_option
@user_errors
def probes(lib: str | None, pid: int | None, fn_pattern: tuple[str, ...], as_json: bool) -> None:
    """List probe sites: the catalog, or the functions of LIB.

    \b
    Without LIB: the catalogued functions (CUDA driver, NCCL, cuBLAS, cuFFT).
    With LIB: its functions matching --fn, the probe offset, and whether the
    kernel must single-step the first instruction (slow, ~16 us a hit).
    \b
    Examples:
      gpufault probes
      gpufault probes libcuda --fn 'cuMemAlloc*'
      gpufault probes /usr/lib/x86_64-linux-gnu/libc.so.6 --fn 'mall*'
    """
    # lazy: keeps pyctl.api.probes (+1 module) off `--help`
    from pyctl.api import probes as pr

    if lib is None:
        try:
            rows = pr.catalog_functions()
        except MissingPrerequisite as e:
            raise UserError(str(e)) from None
        click.echo(json.dumps(rows, indent=2) if as_json else pr.render_catalog(rows))
        return
    sites = pr.probe_sites(lib, pid, fn_pattern)
    click.echo(json.dumps(sites.to_json(), indent=2) if as_json else sites.render())
