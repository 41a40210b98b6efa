"""Talking to running gpufault controllers (pyctl/control.py: their control
sockets in the run directory): release the threads their stall faults
hold, as `gpufault release` does."""

from __future__ import annotations

from typing import Any

from pyctl.exceptions import GpufaultError


def release(ctl_pid: int | None = None) -> Any:
    """Ask every running controller (or the one with pid ctl_pid) to release
    its held threads now; pyctl.control.release's result (how many were
    released, the stale sockets removed, those refused as not root's).
    GpufaultError with the one line when it cannot be asked."""
    # lazy: keeps pyctl.control (ast, copy, +19 modules, ~300 ms) off `import gpufault`
    from pyctl.control import ControlError
    from pyctl.control import release as release_all

    try:
        return release_all(ctl_pid)
    except ControlError as e:
        raise GpufaultError(str(e)) from None


__all__ = ["release"]
