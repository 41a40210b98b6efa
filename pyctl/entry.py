"""The `gpufault` entry point (and `python -m pyctl`): the CLI, after
starting the BPF object's load for the commands that attach to a running
process (`trace`, `inject`), whose start-up is the time to probes live.

The load runs on a thread (pyctl/bpf/main_object.py says why and when its
object is used) while click and the CLI are imported; so this module
imports nothing heavy and scans argv by hand, before click exists.
GPUFAULT_NO_EARLY_LOAD=1 turns it off. A plain `trace --pid` goes further:
its probes are attached before click is imported (pyctl/early.py).
Before that, a `--pid` run is handed to `gpufault serve` when one listens
(pyctl/resident/client.py): then nothing else here runs.
"""

from __future__ import annotations

import os
import sys

from pyctl.argv import PlainTrace, command_of, plain_trace

# The commands whose start-up is the time to probes live (pyctl/cli: they
# also register alone instead of importing every command module).
ATTACH_COMMANDS = ("trace", "inject")


def attaches(argv: list[str]) -> bool:
    """A `trace` or `inject` that will attach (not its --help)."""
    return command_of(argv) in ATTACH_COMMANDS and not {"--help", "-h"} & set(argv)


def servable(argv: list[str]) -> bool:
    """An attach to a running process (`--pid`), the only kind `gpufault
    serve` runs: a `-- CMD` run keeps its command in this terminal's
    process group, so it stays in-process."""
    return attaches(argv) and "--" not in argv and "--version" not in argv


def attach_early(plain: PlainTrace) -> None:
    """A plain `trace --pid`: its probes in now, before click and the CLI
    are imported (pyctl/early.py); an early start that fails leaves the
    run to the CLI alone."""
    # lazy: keeps pyctl.early (the engine, +40 modules) off every other command's start
    from pyctl import early

    try:
        early.attach(plain)
    except KeyboardInterrupt:  # Ctrl-C before the CLI's handlers: as the CLI says it
        from pyctl.errors import EXIT_INTERRUPTED  # lazy: only on this way out

        print("gpufault: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def main() -> None:
    # lazy: pyctl.stdfds only when this runs
    from pyctl.stdfds import fill_std_fds

    # Before anything opens a file: a closed 0/1/2 would be given to it.
    fill_std_fds()
    argv = sys.argv[1:]
    if servable(argv):
        # lazy: keeps pyctl.resident.client (+5 modules) off trace's start and `--help`
        from pyctl.resident import client

        status = client.try_serve(argv)
        if status is not None:
            sys.exit(status)
    if attaches(argv):
        # lazy: keeps pyctl.bpf.main_object (+25 modules, ~200 ms) off `trace --help`
        from pyctl.bpf import main_object

        on = servable(argv) and not os.environ.get("GPUFAULT_NO_EARLY_ATTACH")
        plain = plain_trace(argv) if on else None
        # A plain trace attaches from here (pyctl/early.py): its uprobe
        # registration warmed up meanwhile (pyctl/bpf/warmup.py).
        main_object.start_early(command_of(argv) or "inject", warm=plain is not None)
        if plain is not None:
            attach_early(plain)
    # lazy: pyctl.cli (ast, click, +49 modules, ~300 ms) only when this runs
    from pyctl.cli import main as cli_main

    cli_main()
