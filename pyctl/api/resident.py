"""`gpufault serve`, the resident controller (docs/resident.md), as the
library sees it from outside: where it listens, and whether one runs this
code. (The server itself, pyctl/resident/server.py, is a front end.)"""

from __future__ import annotations


def socket_path() -> str:
    """$GPUFAULT_RUN_DIR/serve.sock (/run/gpufault/serve.sock): where `trace`
    and `inject` look first."""
    # lazy: pyctl.resident.wire (+4 modules) only when this runs
    from pyctl.resident import wire

    return str(wire.socket_path())


def ping() -> tuple[int, bool] | None:
    """(the server's pid, whether it runs this very code), or None when none
    answers."""
    # lazy: pyctl.resident.client (+5 modules) only when this runs
    from pyctl.resident import client

    return client.ping()


__all__ = ["ping", "socket_path"]
