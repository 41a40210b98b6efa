"""The run directory ($GPUFAULT_RUN_DIR, /run/gpufault): where each
controller's release socket (pyctl/control.py) and `gpufault serve`'s
socket (pyctl/resident) live.

Root trusts what is in it (a socket there is a root controller), so it
must be root's alone. Another local user may have set GPUFAULT_RUN_DIR,
created the directory first, made it 1777 or a symbolic link to
somewhere else: gpufault then refuses it, with one line, and never
changes its mode (a chmod would follow the link, or take a shared
directory away from its users). One it creates itself is 0700.

Light on purpose (os, stat, errno, _socket): the resident client checks
the directory and the listener before anything of the CLI is imported.
connect_root() is the one way a client (the resident client, `gpufault
release`) reaches a socket here.
"""

from __future__ import annotations

# The C module under socket (as the resident client imports it): the
# Python wrapper's enum classes cost start-up and add nothing here.
import _socket as socket
import errno
import os
import stat
import struct

DEFAULT = "/run/gpufault"


def path() -> str:
    return os.environ.get("GPUFAULT_RUN_DIR") or DEFAULT  # empty: unset


class UnsafeRunDir(OSError):
    """The directory is not root's alone. str(): the line for the user
    (what, and what to do); .what: the first half. An OSError (EPERM) so
    that callers which already turn an OSError into a warning (the
    release socket) keep doing so."""

    def __init__(self, what: str) -> None:
        super().__init__(
            errno.EPERM,
            f"{what}: use a directory only root can write "
            "(unset GPUFAULT_RUN_DIR for /run/gpufault)",
        )
        self.what = what

    def __str__(self) -> str:
        return str(self.strerror)


def _unsafe(what: str, d: str) -> UnsafeRunDir:
    return UnsafeRunDir(f"run directory {d} {what}")


def _check_ancestors(d: str, owner: int) -> None:
    """Every directory above d (links resolved): owned by root or owner,
    and not writable by others unless sticky (/tmp: others cannot rename
    or remove what root made there). Otherwise whoever can write one of
    them can swap d for a directory of their own after the check."""
    parent = os.path.realpath(os.path.dirname(d))
    cur = "/"
    for part in ["", *[p for p in parent.split("/") if p]]:
        cur = os.path.join(cur, part) if part else "/"
        st = os.lstat(cur)
        if st.st_uid not in (0, owner):
            raise _unsafe(f"is inside {cur}, owned by uid {st.st_uid}", d)
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise _unsafe(
                f"is inside {cur}, writable by others (mode {st.st_mode & 0o7777:04o})", d
            )


def open_dir(d: str | None = None, *, create: bool, owner: int = 0) -> int:
    """An O_PATH descriptor of the run directory, checked on the descriptor:
    a real directory (not a link), owned by `owner`, writable by nobody
    else. create: make it (0700) if it is missing, never chmod one that
    exists. Raises UnsafeRunDir, or FileNotFoundError (not create)."""
    d = os.path.abspath(d if d is not None else path())
    if create:
        os.makedirs(os.path.dirname(d), mode=0o755, exist_ok=True)
    _check_ancestors(d, owner)
    if create:
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "is a symbolic link" if os.path.islink(d) else "is not a directory"
            raise _unsafe(kind, d) from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != owner:
            raise _unsafe(f"is owned by uid {st.st_uid}, not {owner}", d)
        if st.st_mode & 0o022:
            raise _unsafe(f"is writable by others (mode {st.st_mode & 0o7777:04o})", d)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fd_path(fd: int, name: str) -> str:
    """NAME inside the directory open as fd, by a path that goes through
    the descriptor (not the directory's name, which may be swapped)."""
    return f"/proc/self/fd/{fd}/{name}"


_TIMEVAL = struct.Struct("=qq")  # struct timeval (x86-64, aarch64)
_CRED = struct.Struct("=iII")  # struct ucred: pid, uid, gid


class UntrustedPeer(OSError):
    """The socket's listener is not root: nothing may be sent to it."""

    def __init__(self, uid: int) -> None:
        super().__init__(errno.EPERM, f"served by uid {uid}, not root")
        self.uid = uid


def peer_cred(s: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end (SO_PEERCRED), the pid
    as this process's PID namespace sees it."""
    pid, uid, _gid = _CRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def connect_root(s: socket.socket, fd: int, name: str, *, timeout_s: float) -> tuple[int, int]:
    """Connect the AF_UNIX stream socket s to NAME in the run directory
    open as fd (from open_dir: checked on the descriptor), and return the
    listener's (pid, uid) once SO_PEERCRED says it is root. Nothing is
    sent: a listener that is not root raises UntrustedPeer, which no file
    mode, link or rename in the directory can fake.

    A blocking AF_UNIX connect waits for room in a full backlog as long as
    SO_SNDTIMEO says, then fails with BlockingIOError (EAGAIN, the
    kernel's unix_stream_connect); settimeout() would fail it at once."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _TIMEVAL.pack(int(timeout_s), 0))
    s.connect(fd_path(fd, name))
    pid, uid = peer_cred(s)
    if uid != 0:
        raise UntrustedPeer(uid)
    return pid, uid


__all__ = [
    "DEFAULT",
    "UnsafeRunDir",
    "UntrustedPeer",
    "connect_root",
    "fd_path",
    "open_dir",
    "path",
    "peer_cred",
]
