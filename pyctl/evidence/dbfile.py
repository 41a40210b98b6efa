"""Where the evidence database is, and who else could touch it.

gpufault runs as root; --db is a path the user typed, and any component of
it may belong to another local user. SQLite opens its files by path (the
database, then `-wal`, `-shm` and `-journal` named after it), and it
follows a symlink in the database's own path. So a user who can write
the database's directory can swap `DIR/r.db` between a file and a
symlink and have root's SQLite open, convert and fill a root-owned file
elsewhere (fs.protected_symlinks=0 does not stop it), or pre-create the
file or a sidecar as their own and read every fault written to it.

Checking the path and then handing it to SQLite is a race whatever is
checked. What is safe is a path that only root can change. So:

1. The path is walked from / one component at a time with
   openat(O_DIRECTORY|O_NOFOLLOW) on the parent's fd, and every
   directory is checked by fstat on its own fd (never by path): owned
   by root, and not writable by group or others unless sticky. In a
   sticky directory (/tmp) only an entry's owner may rename or remove
   it, and the next component must be root's, so nobody else can move
   it either. A symlink in the directory part is followed only if root
   owns it (its directory being root's, nobody else can replace it);
   the database's own name must not be a link at all.
2. A writer (trace, inject, experiments) also refuses a database whose
   directory others can create files in (a sticky /tmp): SQLite creates
   `-wal`/`-shm` there by name, with O_NOFOLLOW but without O_EXCL, so a
   file another user plants first would receive the evidence. In a
   directory only root can write, no such name can appear.
3. The database is opened by openat(O_NOFOLLOW) on the directory's fd
   (created with O_CREAT|O_EXCL, 0600) and checked on that fd: a
   regular file, owned by root, one link (a hard link would make
   another root-owned file the database). Every sidecar that exists is
   checked the same way (lstat on the directory's fd).
4. SQLite then gets the canonical path of what was walked (links
   already resolved, so it resolves nothing itself): every name in it
   is root's to change alone, so it opens the inode that was checked;
   `same_file` confirms it on the directory's fd after the open.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

SIDECARS = ("-wal", "-shm", "-journal")
_MAX_LINKS = 40  # as the kernel's path walk (ELOOP)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(Exception):
    """A one-line reason --db is refused (store.open_db makes it a
    StoreError)."""


class Located:
    """The database's directory, open, and its checked canonical path."""

    def __init__(self, dir_fd: int, dir_path: str, name: str, shared: bool) -> None:
        self.dir_fd = dir_fd
        self.dir_path = dir_path
        self.name = name
        self.shared = shared  # others may create names in the directory (sticky)

    @property
    def path(self) -> str:
        return os.path.join(self.dir_path, self.name)

    def close(self) -> None:
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def lstat(self, suffix: str = "") -> os.stat_result | None:
        try:
            return os.stat(self.name + suffix, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UnsafePath(f"{self.path}{suffix}: {e.strerror}") from None

    def same_file(self, st: os.stat_result) -> bool:
        """The name in the directory is still the inode `st` was taken of."""
        now = self.lstat()
        return now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)

    def check_sidecars(self) -> None:
        """Every -wal/-shm/-journal there is a regular file of root's with
        one link (SQLite would use a planted one as it is)."""
        for suffix in SIDECARS:
            st = self.lstat(suffix)
            if st is not None:
                check_file(st, self.path + suffix)

    def fix_sidecar_modes(self) -> None:
        """0600 on the sidecars. By name in the walked directory, not by an
        fd: closing an fd of the -shm would drop this process's POSIX
        locks on it, SQLite's too, and the next reader would take the WAL
        index for abandoned and rebuild it under the writer. A writer's
        directory is root's alone (store._locate), so the name checked by
        lstat is the file chmod-ed."""
        for suffix in SIDECARS:
            st = self.lstat(suffix)
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_uid != 0:
                continue
            if st.st_mode & 0o077:
                os.chmod(self.name + suffix, 0o600, dir_fd=self.dir_fd)


def check_file(st: os.stat_result, shown: str) -> None:
    """The database or a sidecar: a regular file, root's, one link."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{shown}: is a symbolic link; pass the real path of the database")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{shown}: not a regular file")
    if st.st_uid != 0:
        raise UnsafePath(
            f"{shown}: owned by uid {st.st_uid}, not root, who could read the evidence; "
            "remove it or pass another --db"
        )
    if st.st_nlink != 1:
        raise UnsafePath(
            f"{shown}: has {st.st_nlink} hard links (another name could be a root file "
            "elsewhere); pass another --db"
        )


def _check_dir(fd: int, shown: str) -> bool:
    """A directory on the way: root's, and writable by no one else unless
    sticky. True: others may create entries in it (sticky)."""
    st = os.fstat(fd)
    if st.st_uid != 0:
        raise UnsafePath(
            f"{shown}: owned by uid {st.st_uid}, who could swap the database under root; "
            "pass a --db in a directory only root can write"
        )
    writable = bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
    if writable and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(
            f"{shown}: writable by other users, who could swap the database under root; "
            "pass a --db in a directory only root can write"
        )
    # On a read-only mount nobody creates anything, whatever the mode
    # (a tmpfs mounted ro is 1777); only root could remount it.
    return writable and not os.fstatvfs(fd).f_flag & os.ST_RDONLY


def locate(
    path: str | os.PathLike[str],
    *,
    mkdirs: bool = False,
    on_mkdir: Callable[[int], None] | None = None,
) -> Located:
    """Walk `path`'s directories from / by fd (module docstring, 1). A
    missing directory is an error, or (mkdirs: the default path) made
    0700. Raises UnsafePath with a one-line message."""
    text = os.fspath(path)
    if not text:
        raise UnsafePath("--db is empty: pass the path of the database")
    if not text.startswith("/"):
        # getcwd() is only text: every component of it is walked below.
        text = os.path.join(os.getcwd(), text)
    parts = [c for c in text.split("/") if c not in ("", ".")]
    if not parts or parts[-1] == "..":
        raise UnsafePath(f"{path}: not a regular file")
    name = parts.pop()
    fd = os.open("/", _DIR)
    up: list[int] = []  # fds of the directories above fd, for ".."
    names: list[str] = []  # fd's canonical path, by component
    links = 0
    try:
        shared = _check_dir(fd, "/")
        pending = list(reversed(parts))
        while pending:
            c = pending.pop()
            shown = "/" + "/".join([*names, c])
            if c == "..":
                if up:
                    os.close(fd)
                    fd = up.pop()
                    names.pop()
                    shared = _check_dir(fd, "/" + "/".join(names))
                continue
            try:
                nfd = os.open(c, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not mkdirs:
                    raise UnsafePath(
                        f"{shown}: no such directory (create it, or pass another --db)"
                    ) from None
                try:
                    os.mkdir(c, 0o700, dir_fd=fd)
                    nfd = os.open(c, _DIR, dir_fd=fd)
                    if on_mkdir is not None:
                        on_mkdir(nfd)
                except OSError as e:
                    raise UnsafePath(f"{shown}: {e.strerror}") from None
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePath(f"{shown}: {e.strerror}") from None
                st = os.stat(c, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise UnsafePath(f"{shown}: not a directory") from None
                if st.st_uid != 0:
                    raise UnsafePath(
                        f"{shown}: a symbolic link owned by uid {st.st_uid}; "
                        "pass the real path of the database"
                    ) from None
                links += 1
                if links > _MAX_LINKS:
                    raise UnsafePath(f"{path}: too many levels of symbolic links") from None
                target = os.readlink(c, dir_fd=fd)
                if target.startswith("/"):
                    for f in up:
                        os.close(f)
                    up.clear()
                    names.clear()
                    os.close(fd)
                    fd = os.open("/", _DIR)
                    shared = _check_dir(fd, "/")
                pending.extend(reversed([t for t in target.split("/") if t not in ("", ".")]))
                continue
            up.append(fd)
            fd = nfd
            names.append(c)
            shared = _check_dir(fd, shown)
    except OSError as e:  # a name that changed under a root-owned link, EACCES, ...
        os.close(fd)
        raise UnsafePath(f"{path}: {e.strerror or e}") from None
    except BaseException:
        os.close(fd)
        raise
    finally:
        for f in up:
            os.close(f)
    return Located(fd, "/" + "/".join(names), name, shared)
