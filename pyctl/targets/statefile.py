"""Read a container runtime's state files as root, trusting only root.

Runtime state (/run/crun, /run/containerd, /var/lib/docker, ...) decides
which processes gpufault injects into, so a file another user could
write or swap is not state: every directory on the path is opened by
descriptor without following links and must be root's and writable by
root alone, and so must the file. Anything else reads as absent, the way
a runtime that is not installed reads.
"""

from __future__ import annotations

import os
import stat

_LIMIT = 4 << 20  # no runtime writes state files this large


def _trusted(st: os.stat_result) -> bool:
    return st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def open_dir(path: str) -> int | None:
    """An O_PATH descriptor of the absolute directory path, walked a
    component at a time (no links), every component root's; None when
    absent or not trusted."""
    if not path.startswith("/"):
        return None
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [p for p in path.split("/") if p]:
            if part in (".", ".."):
                return None
            try:
                nfd = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=fd)  # fmt: skip
            except OSError:
                return None
            os.close(fd)
            fd = nfd
            if not _trusted(os.fstat(fd)):
                return None
        out, fd = fd, -1
        return out
    finally:
        if fd >= 0:
            os.close(fd)


def list_dir(path: str) -> list[str]:
    """Names in a trusted directory ([] when absent or not trusted)."""
    fd = open_dir(path)
    if fd is None:
        return []
    try:
        # O_PATH descriptors cannot be listed: reopen it as a directory.
        dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return []
    finally:
        os.close(fd)
    try:
        return sorted(os.listdir(dfd))
    finally:
        os.close(dfd)


def read(path: str, limit: int = _LIMIT) -> bytes | None:
    """A trusted regular file's bytes, None when absent or not trusted."""
    head, _, name = path.rpartition("/")
    if not name or name in (".", ".."):
        return None
    dfd = open_dir(head or "/")
    if dfd is None:
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _trusted(st) or st.st_size > limit:
            return None
        chunks, left = [], limit
        while left > 0:
            b = os.read(fd, min(left, 1 << 16))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
