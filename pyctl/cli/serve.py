"""`gpufault serve`: the resident controller (pyctl/resident/server.py)."""

from __future__ import annotations

import os
import signal
import sys

import click

from pyctl.cli.base import UserError


@click.command(name="serve")
def serve() -> None:
    """Keep a controller ready so that `trace --pid` and `inject --pid`
    start in a fraction of the time (docs/resident.md).

    It listens on $GPUFAULT_RUN_DIR/serve.sock (/run/gpufault/serve.sock),
    where `gpufault trace` and `inject` look first, and runs in the
    foreground until SIGTERM or Ctrl-C. Each request forks one controller,
    which runs with the caller's terminal, directory and environment and
    ends with it. `trace` and `inject` with `-- CMD`, and
    any `gpufault` with GPUFAULT_NO_SERVER=1, run in-process as before.

    \b
    Example:
        gpufault serve &
        gpufault trace --pid 1234 --lib libcuda --fn cuLaunchKernel
    """
    # lazy: keeps pyctl.api.resident (+1 module) off `--help`
    from pyctl.api.resident import socket_path

    # lazy: keeps pyctl.resident.server (+11 modules, ~200 ms) off `--help`
    from pyctl.resident.server import ServeError, Server  # a front end beside this one

    if os.geteuid() != 0:
        raise UserError(
            "serve needs root (it loads BPF and forks root controllers): run it with sudo"
        )
    from pyctl.cli import main  # lazy: this module's own package (loaded already)

    server = Server(socket_path(), log=lambda s: click.echo(f"serve: {s}", err=True), command=main)
    try:
        server.bind()
    except ServeError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"cannot listen on {server.path}: {e.strerror}") from None

    def stop(signo: int, _frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        server.preload()

        def ready() -> None:
            click.echo(f"serve: listening on {server.path} (pid {os.getpid()}); "
                       "SIGTERM or Ctrl-C to stop", err=True)  # fmt: skip
            sys.stderr.flush()

        server.serve_forever(ready)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
