"""The host part of run and fault IDs.

A run id is 16 hex digits: 8 that name the host, then 8 random ones
(`5e6f7a8b1a2b3c4d`; its faults `5e6f7a8b1a2b3c4d-7`). The host part is
a hash of the machine's identity, so two nodes' ids differ before their
random halves are even compared (issue 28: evidence of a fleet merged into
one store), and an id says which node it came from.
The random half is what the kernel module carries (a u32 in its uapi);
store.new_run keeps it unique within one store, so the module's records
map back to their run there (pyctl/evidence/anchors.py).

The identity is systemd's machine-id (/etc/machine-id, or D-Bus's copy):
random per installation, stable across reboots, and on a Kubernetes node
the host's own file when the agent's pod mounts it (deploy/). Where there
is none (a bare container image), the kernel's boot id stands in: one per
boot of the host kernel, the same in every namespace, so a node's ids keep
one host part until it reboots. Files are opened without following links
and must be root's: another user cannot choose root's host part.
"""

from __future__ import annotations

import hashlib
import os

from pyctl.safefile import SafeFileError, read_checked

# (path, what it is): tried in order, the first usable one wins.
SOURCES = (
    ("/etc/machine-id", "machine-id"),
    ("/var/lib/dbus/machine-id", "machine-id"),
    ("/proc/sys/kernel/random/boot_id", "boot-id"),
)
_cache: tuple[str, str] | None = None


def _read_id(path: str) -> str | None:
    """The file's first line if it is root's regular file with an id in it."""
    try:
        text = read_checked(path, 128, owner=0).decode("ascii", "replace").strip()
    except SafeFileError:
        return None
    text = text.replace("-", "").lower()
    # systemd writes "uninitialized" into images before first boot
    if len(text) < 16 or any(c not in "0123456789abcdef" for c in text):
        return None
    return text


def host_identity() -> tuple[str, str]:
    """(host part: 8 hex digits, source: "machine-id" | "boot-id" | "none")."""
    global _cache
    if _cache is None:
        for path, source in SOURCES:
            ident = _read_id(path)
            if ident is not None:
                digest = hashlib.sha256(b"gpufault host\0" + ident.encode()).hexdigest()
                part = digest[:8]
                if part == "00000000":  # fault IDs never start with zeros (kmod's own)
                    part = "00000001"
                _cache = (part, source)
                break
        else:
            # no identity at all: a random part for this process, said as such
            _cache = (os.urandom(4).hex(), "none")
    return _cache


def host_part() -> str:
    return host_identity()[0]


def split_run_id(run_id: str) -> tuple[str, str]:
    """(host part, random part) of a 16-hex run id; ("", run_id) for the
    8-hex ids of schema 7 and before, which had no host part."""
    if len(run_id) == 16:
        return run_id[:8], run_id[8:]
    return "", run_id
