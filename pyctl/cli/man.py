"""gpufault(1), generated from the click command tree (`make man`).

    python -m pyctl.cli.man -o build/man/gpufault.1
    man -l build/man/gpufault.1

One section per command, in the order `gpufault --help` lists them, with
its help text and every option's help record as click prints them, so the
page cannot drift from the commands. Plain man(7) macros only (TH SH SS
TP nf fi B I), which man-db, mandoc and groff all render.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from pyctl.api import __version__

ENVIRONMENT = [
    ("GPUFAULT_DB", "the evidence database (as gpufault --db); a command's own --db wins"),
    ("GPUFAULT_DEBUG", "1: show the traceback of an internal error (as --debug)"),
    ("GPUFAULT_TEMPLATES", "more template directories, searched before the shipped ones"),
    (
        "_GPUFAULT_COMPLETE",
        "bash_source, zsh_source or fish_source: print the shell completion script",
    ),
]


def roff_escape(text: str) -> str:
    """Text as roff reads it literally: backslashes, dashes, and a line
    that would start with a control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(
        "\\&" + line if line.startswith((".", "'")) else line for line in text.split("\n")
    )


def _paragraphs(help_text: str) -> Iterator[str]:
    """click's help text as roff: paragraphs fill, a block after \\b keeps
    its lines (examples), as `--help` shows them."""
    for block in re.split(r"\n\s*\n", help_text.strip()):
        lines = block.split("\n")
        if lines[0].strip() == "\b":
            body = lines[1:]
            indent = min((len(ln) - len(ln.lstrip()) for ln in body if ln.strip()), default=0)
            yield ".nf\n" + "\n".join(roff_escape(ln[indent:]) for ln in body) + "\n.fi"
        else:
            yield roff_escape(" ".join(ln.strip() for ln in lines))


def _commands(
    group: click.Group, ctx: click.Context
) -> Iterator[tuple[click.Command, click.Context]]:
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if cmd is None or cmd.hidden:
            continue
        sub = click.Context(cmd, info_name=name, parent=ctx, **cmd.context_settings)
        yield cmd, sub
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, sub)


def _options(cmd: click.Command, ctx: click.Context) -> list[str]:
    out = []
    for param in cmd.get_params(ctx):
        rec = param.get_help_record(ctx)
        if rec is None:
            continue
        opts, help_ = rec
        out.append(f".TP\n.B {roff_escape(opts)}\n{roff_escape(help_) if help_ else ''}".rstrip())
    return out


def render(cli: click.Group) -> str:
    """The whole page, as roff text."""
    root = click.Context(cli, info_name="gpufault", **cli.context_settings)
    summary = (cli.help or "").strip().split("\n", 1)[0]
    page = [
        f'.TH GPUFAULT 1 "" "gpufault {__version__}" "User Commands"',
        ".SH NAME",
        f"gpufault \\- {roff_escape(summary)}",
        ".SH SYNOPSIS",
        ".B gpufault",
        "[\\fIOPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]...",
        ".SH DESCRIPTION",
        *list(_paragraphs(cli.help or ""))[1:],
        ".SH OPTIONS",
        *_options(cli, root),
        ".SH COMMANDS",
    ]
    for cmd, ctx in _commands(cli, root):
        usage = " ".join(cmd.collect_usage_pieces(ctx))
        page.append(f'.SS "{roff_escape(ctx.command_path)} {roff_escape(usage)}"')
        for para in _paragraphs(cmd.help or cmd.short_help or ""):
            page += [para, ".PP"]
        page += _options(cmd, ctx)
    page.append(".SH ENVIRONMENT")
    for name, what in ENVIRONMENT:
        page += [".TP", f".B {roff_escape(name)}", roff_escape(what)]
    page += [
        ".SH FILES",
        ".TP",
        ".B /var/lib/gpufault/gpufault.db",
        "the default evidence database",
        ".SH SEE ALSO",
        "docs/cli.md in the gpufault source (value types, completion, JSON output).",
    ]
    return "\n".join(page) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write gpufault(1), generated from the commands")
    ap.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    a = ap.parse_args(argv)
    # lazy: the command tree (every command module) only when the page is written
    from pyctl.cli import cli

    text = render(cli)
    if a.output == "-":
        sys.stdout.write(text)
    else:
        out = Path(a.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
