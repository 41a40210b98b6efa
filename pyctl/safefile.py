"""Read a small file a root tool was pointed at, on a machine where anyone
may own that path (docs/security.md).

One way to do it, so every reader checks the same things: the name is
opened with O_NOFOLLOW (a symbolic link is refused, not followed),
O_NONBLOCK (a FIFO planted at the name cannot hang the open) and
O_NOCTTY; the file is then checked on the descriptor, never by path (a
regular file; owner and mode if asked), and at most `max_bytes` + 1 bytes
are read, so a file that grows after the check is still caught.

Callers word their own one-line errors from `SafeFileError.why`:
"link", "open", "type", "owner", "mode", "size" or "read".
"""

from __future__ import annotations

import errno
import os
import stat


class SafeFileError(Exception):
    """why: what failed (see the module docstring); detail: the OS's words,
    the owner's uid, the mode or the size, as the case may be."""

    def __init__(self, why: str, detail: str = "", st: os.stat_result | None = None) -> None:
        super().__init__(f"{why}: {detail}" if detail else why)
        self.why = why
        self.detail = detail
        self.st = st


def read_checked(
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    owner: int | None = None,
    private: bool = False,
) -> bytes:
    """The file's bytes. owner: the uid it must have; private: no access
    for group or others (mode & 0o077 == 0). SafeFileError otherwise."""
    p = os.fspath(path)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(p, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SafeFileError("link") from None
        raise SafeFileError("open", e.strerror or str(e)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SafeFileError("type", st=st)
        if owner is not None and st.st_uid != owner:
            raise SafeFileError("owner", str(st.st_uid), st)
        if private and st.st_mode & 0o077:
            raise SafeFileError("mode", f"{st.st_mode & 0o777:04o}", st)
        if st.st_size > max_bytes:
            raise SafeFileError("size", str(st.st_size), st)
        chunks, got = [], 0
        while got <= max_bytes:  # it may grow after fstat: read at most the limit + 1
            b = os.read(fd, min(1 << 20, max_bytes + 1 - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
    except OSError as e:
        raise SafeFileError("read", e.strerror or str(e)) from None
    finally:
        os.close(fd)
    if got > max_bytes:
        raise SafeFileError("size", f"over {max_bytes}")
    return b"".join(chunks)


__all__ = ["SafeFileError", "read_checked"]
