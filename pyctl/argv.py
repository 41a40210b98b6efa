"""Reading a gpufault command line by hand, before click is imported: the
entry point (pyctl/entry.py) and the CLI's fast registration
(pyctl/cli/__init__.py) both ask which command argv names. Its own module
so that neither imports the other (they did: an import cycle)."""

from __future__ import annotations


def command_of(argv: list[str]) -> str | None:
    """The command word after the root group's own options (--debug, --db
    PATH, --db=PATH), or None when there is none."""
    i = 0
    while (
        i < len(argv)
        and argv[i] in ("--debug", "--db")
        or (i < len(argv) and argv[i].startswith("--db="))
    ):
        i += 2 if argv[i] == "--db" else 1
    return argv[i] if i < len(argv) else None
