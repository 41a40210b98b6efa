"""Where tracefs is, and mounting it when a feature needs it.

The engine needs no tracefs: its signal and exit programs are BTF-typed
tracepoints and the Xid program a raw tracepoint, attached by BTF id or
name through bpf(2). Two things still read tracefs: the tokenizer layer's
plain uprobe counter (uprobe_events) and the Xid program's fallback for
drivers whose tracepoint arguments are not the ones we know (the record
layout then comes from the `format` file). For those, `ensure()` mounts
tracefs where the kernel expects it and says so in one line, as bpftool
does for bpffs; the mount is the user's to keep or undo.
"""

from __future__ import annotations

import ctypes
import os
import sys

from pyctl.exceptions import MissingPrerequisite

DIRS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
MOUNT_AT = "/sys/kernel/tracing"


class TracefsError(MissingPrerequisite):
    """One line for the user: what is missing and what to do."""


def find() -> str | None:
    """The mounted tracefs (a directory with events/), or None."""
    for p in DIRS:
        if os.path.isdir(os.path.join(p, "events")):
            return p
    return None


def _mount(where: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 4 + [ctypes.c_ulong, ctypes.c_void_p]
    if libc.mount(b"nodev", where.encode(), b"tracefs", None, 0, None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def ensure(why: str) -> str:
    """tracefs's path, mounting it at /sys/kernel/tracing if nothing is
    mounted (one line on stderr says so). TracefsError if that fails."""
    tf = find()
    if tf is not None:
        return tf
    if os.geteuid() != 0:
        raise TracefsError(f"tracefs is not mounted ({why} needs it): run as root, "
                           f"or mount -t tracefs nodev {MOUNT_AT}")
    if not os.path.isdir(MOUNT_AT):
        raise TracefsError(f"{MOUNT_AT} does not exist (kernel without CONFIG_TRACING?): "
                           f"{why} is unavailable on this kernel")
    try:
        _mount(MOUNT_AT)
    except OSError as e:
        raise TracefsError(f"cannot mount tracefs at {MOUNT_AT} ({e.strerror}): "
                           f"mount -t tracefs nodev {MOUNT_AT}, then retry") from None
    if find() is None:
        raise TracefsError(f"tracefs mounted at {MOUNT_AT} has no events/: "
                           "kernel without CONFIG_EVENT_TRACING")
    print(f"gpufault: mounted tracefs at {MOUNT_AT} for {why} "
          f"(umount {MOUNT_AT} to undo)", file=sys.stderr)
    return MOUNT_AT
