"""Write initramfs images in the kernel's cpio "newc" format.

Written here rather than with the cpio tool so that /dev/console can be a
device node in the archive without mknod (the kernel opens it for init's
stdio before any devtmpfs is mounted) and so the output is reproducible."""

from __future__ import annotations

import stat
from dataclasses import dataclass


@dataclass
class Entry:
    path: str  # inside the archive, no leading '/'
    mode: int  # full st_mode: type bits | permissions
    data: bytes = b""
    rdev: tuple[int, int] = (0, 0)


def _pad4(n: int) -> bytes:
    return b"\0" * (-n % 4)


def _header(ino: int, e: Entry, namesize: int) -> bytes:
    fields = (
        ino, e.mode, 0, 0, 1, 0,  # ino mode uid gid nlink mtime
        len(e.data), 0, 0,  # filesize devmajor devminor
        e.rdev[0], e.rdev[1], namesize, 0,  # rdevmajor rdevminor namesize check
    )  # fmt: skip
    return b"070701" + b"".join(b"%08X" % f for f in fields)


def newc(entries: list[Entry]) -> bytes:
    """An archive holding entries (parents before children), plus trailer."""
    out = bytearray()
    for ino, e in enumerate([*entries, Entry("TRAILER!!!", 0)], start=1):
        name = e.path.encode() + b"\0"
        hdr = _header(ino, e, len(name))
        out += hdr + name + _pad4(len(hdr) + len(name))
        out += e.data + _pad4(len(e.data))
    # The kernel reads archives in 512-byte blocks; pad for concatenation.
    out += b"\0" * (-len(out) % 512)
    return bytes(out)


def directory(path: str) -> Entry:
    return Entry(path, stat.S_IFDIR | 0o755)


def file(path: str, data: bytes, mode: int = 0o644) -> Entry:
    return Entry(path, stat.S_IFREG | mode, data)


def chardev(path: str, major: int, minor: int) -> Entry:
    return Entry(path, stat.S_IFCHR | 0o600, rdev=(major, minor))
