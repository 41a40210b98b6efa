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


# `gpufault trace --pid` as the entry reads it to attach before click is
# imported (pyctl/early.py): the options that shape the probe, and those
# that only shape what happens after it (the summary, how loud), which
# the CLI reads again. Anything else (another option, a `--`, a value that
# looks like an option, an option given twice) is not read here: the
# line goes to click alone, as before.
_TRACE_VALUES = {"--pid": "pid", "-p": "pid", "--lib": "lib", "--fn": "fn", "--db": "db",
                 "--duration": "duration"}  # fmt: skip
_TRACE_FLAGS = {"--no-stack": "no_stack", "--entry-only": "entry_only", "--quiet": "quiet",
                "-q": "quiet", "--summary": "", "--no-summary": "", "--per-thread": "",
                "--json": ""}  # fmt: skip


class PlainTrace:
    """What plain_trace read: strings as typed, flags as bools."""

    def __init__(self) -> None:
        self.pid = 0
        self.lib = ""
        self.fn: list[str] = []
        self.db: str | None = None  # the command's own --db
        self.root_db: str | None = None  # `gpufault --db PATH trace ...`
        self.duration: str | None = None
        self.no_stack = False
        self.entry_only = False
        self.quiet = False


def plain_trace(argv: list[str]) -> PlainTrace | None:
    """argv of `[--db PATH] trace --pid N --lib L --fn F [--fn F2 ...]` with
    only the options above; None for any other line. Spelling only: click
    converts the values and checks the line whole afterwards, and the
    early probe is used only when what click made of it is the same run
    (pyctl/early.py)."""
    out = PlainTrace()
    i = 0
    while i < len(argv) and argv[i] != "trace":  # the root group's --db only
        a = argv[i]
        if a == "--db" and i + 1 < len(argv) and out.root_db is None:
            out.root_db, i = argv[i + 1], i + 2
        elif a.startswith("--db=") and out.root_db is None:
            out.root_db, i = a[5:], i + 1
        else:
            return None
    if i >= len(argv):
        return None
    args = argv[i + 1 :]
    seen: set[str] = set()
    j = 0
    while j < len(args):
        name, eq, value = args[j].partition("=") if args[j].startswith("--") else (args[j], "", "")
        flag = _TRACE_FLAGS.get(name)
        if flag is not None and not eq:
            if flag:
                setattr(out, flag, True)
            j += 1
            continue
        key = _TRACE_VALUES.get(name)
        if key is None or (key in seen and key != "fn"):
            return None
        seen.add(key)
        if not eq:
            if j + 1 >= len(args):
                return None
            value = args[j + 1]
        j += 1 if eq else 2
        if not value or value.startswith("-"):
            return None
        if key == "fn":
            out.fn.append(value)
        elif key == "pid":
            if not value.isdigit():
                return None
            out.pid = int(value)
        else:
            setattr(out, key, value)
    if not out.pid or not out.lib or not out.fn:
        return None
    return out
