"""`gpufault doctor` (what this host allows) and `gpufault probes` (where a
probe can go): the checks before a run."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

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
    from pyctl.capabilities import DEFAULT_FEATURES, FEATURES, checks, failed_for

    want = list(FEATURES) if "all" in features else list(features or DEFAULT_FEATURES)
    res = checks()
    bad = failed_for(res, want)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "features": {f: FEATURES[f] for f in want},
                    "ok": not bad,
                    "checks": [
                        dict(c.__dict__, required=bool(set(want) & set(c.required_for)))
                        for c in res
                    ],
                },
                indent=2,
            )
        )
    else:
        for c in res:
            req = bool(set(want) & set(c.required_for))
            click.echo(f"{mark(c.ok, req)} {c.name:22} {c.detail}")
            if not c.ok and c.fix:
                click.echo(f"     {'':22} fix: {c.fix}")
        if bad:
            click.echo(
                f"gpufault: {', '.join(c.name for c in bad)} failed: "
                f"{' / '.join(want)} cannot run here until fixed",
                err=True,
            )
    if bad:
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
    from pyctl.symbols import resolve

    rows: list[dict[str, Any]]
    if lib is None:
        try:
            from pyctl import catalog
        except ImportError:
            raise UserError("no catalog installed") from None
        rows = [
            {
                "lib": f.lib,
                "function": f.name,
                "args": ", ".join(f"{a.ctype} {a.name}" for a in f.args),
            }
            for f in catalog.functions()
        ]
        if as_json:
            click.echo(json.dumps(rows, indent=2))
        else:
            for r in rows:
                click.echo(f"{r['lib']:7} {r['function']}({r['args']})")
        return
    from pyctl.symbols.demangle import demangle

    L = resolve.find_library(lib, pid)
    syms = resolve.symbols(L, list(fn_pattern) or ["*"])
    rows = [
        {
            "function": s.name,  # as in the file: what --fn takes
            "demangled": demangle(s.name),
            "aliases": s.aliases,
            "address": s.address,
            "offset": s.offset,
            "first_insn": s.first_insn,
            "skipped_endbr64": s.skipped_endbr,
            "slow": s.slow,
        }
        for s in sorted(syms, key=lambda s: s.name)
    ]
    if as_json:
        click.echo(
            json.dumps({"library": L.display, "mapped": L.mapped, "functions": rows}, indent=2)
        )
        return
    names = sum(1 + len(r["aliases"]) for r in rows)
    click.echo(
        f"{L.display} ({'mapped' if L.mapped else 'on disk'}), {len(rows)} functions"
        + (f" ({names} names: aliases share one probe site)" if names > len(rows) else "")
    )
    for r in rows:
        note = (
            "SLOW (single-stepped)"
            if r["slow"]
            else ("after endbr64" if r["skipped_endbr64"] else "")
        )
        # Aliases (cuMemAlloc = cuMemAlloc_v2) are one address: shown beside
        # the name, never hidden (--fn takes any of them).
        shown = " = ".join([r["demangled"], *(demangle(a) for a in r["aliases"])])
        click.echo(f"  {shown:40} +{r['offset']:#x} {r['first_insn']:8} {note}")
