"""What /proc says about one process, for the target selectors: its
name, cgroups, namespaces, the pids its own PID namespaces give it, its
children and the libraries it maps.

/proc is the kernel's, so these files need no ownership checks; a process
may exit between any two reads, so every reader returns an empty answer
(None, (), {}) for a process that is gone instead of raising.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

# The init PID namespace's inode number is fixed (PROC_PID_INIT_INO).
HOST_PID_NS_INO = 0xEFFFFFFC
# Environment variables that name a process's rank in a multi-process job,
# in the order they are trusted: torchrun/torch.distributed, Open MPI,
# MPICH/PMI, Slurm's srun.
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_ENVIRON_MAX = 1 << 20  # a process's environment larger than this is not read


def _read(path: str, limit: int = 1 << 16) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks, left = [], limit
        while left > 0:
            b = os.read(fd, min(left, 65536))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def pids() -> Iterator[int]:
    """Every process (thread-group leader) /proc lists now."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for n in names:
        if n.isdigit():
            yield int(n)


def comm(pid: int) -> str | None:
    b = _read(f"/proc/{pid}/comm", 64)
    return b.decode(errors="replace").rstrip("\n") if b is not None else None


def thread_comms(pid: int) -> dict[int, str]:
    """tid -> thread name of each live thread of pid."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for t in tids:
        if t.isdigit():
            b = _read(f"/proc/{pid}/task/{t}/comm", 64)
            if b is not None:
                out[int(t)] = b.decode(errors="replace").rstrip("\n")
    return out


def is_kernel_thread(pid: int) -> bool:
    st = _read(f"/proc/{pid}/stat", 4096)
    if st is None:
        return False
    fields = st[st.rfind(b")") + 2 :].split()
    try:
        return bool(int(fields[6]) & 0x00200000)  # PF_KTHREAD
    except (IndexError, ValueError):
        return False


def cgroups(pid: int) -> list[tuple[str, str]]:
    """(controllers, path) of each hierarchy pid is in: ("", "/a/b") for
    cgroup v2, ("memory", "/x") or ("name=systemd", "/y") for v1."""
    b = _read(f"/proc/{pid}/cgroup")
    if b is None:
        return []
    out = []
    for line in b.decode(errors="replace").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((parts[1], parts[2]))
    return out


def ns_inode(pid: int, kind: str) -> int | None:
    """The inode of pid's namespace of kind (pid, mnt, net ...)."""
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def signal_mask(pid: int, field: str) -> int | None:
    """A signal mask of pid's /proc status (SigCgt: the signals it has a
    handler for; SigIgn, SigBlk), bit signo-1; None when gone."""
    b = _read(f"/proc/{pid}/status", 1 << 16)
    if b is None:
        return None
    for line in b.decode(errors="replace").splitlines():
        if line.startswith(field + ":"):
            try:
                return int(line.split()[1], 16)
            except (IndexError, ValueError):
                return None
    return None


def ns_pids(pid: int) -> list[int]:
    """NSpid: pid as each PID namespace from the host's down to the
    process's own sees it ([pid] for a process in the host's)."""
    b = _read(f"/proc/{pid}/status", 1 << 16)
    if b is None:
        return []
    for line in b.decode(errors="replace").splitlines():
        if line.startswith("NSpid:"):
            try:
                return [int(x) for x in line.split()[1:]]
            except ValueError:
                return []
    return [pid]


def ns_tid(pid: int, tid: int) -> int | None:
    """tid as its process's own PID namespace sees it."""
    b = _read(f"/proc/{pid}/task/{tid}/status", 1 << 16)
    if b is None:
        return None
    for line in b.decode(errors="replace").splitlines():
        if line.startswith("NSpid:"):
            try:
                return int(line.split()[-1])
            except (IndexError, ValueError):
                return None
    return tid


def children(pid: int) -> list[int]:
    """pid's child processes (every thread's children: a rank is often
    forked by a thread of its launcher)."""
    out: set[int] = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for t in tids:
        b = _read(f"/proc/{pid}/task/{t}/children")
        if b:
            out.update(int(x) for x in b.split() if x.isdigit())
    return sorted(out)


def descendants(pid: int) -> list[int]:
    """Every process below pid, breadth first, pid itself not included."""
    seen: list[int] = []
    todo = children(pid)
    while todo:
        p = todo.pop(0)
        if p in seen:
            continue
        seen.append(p)
        todo.extend(children(p))
    return seen


def mapped_files(pid: int) -> set[str]:
    """Paths (as the process sees them) of the files pid maps executable."""
    b = _read(f"/proc/{pid}/maps", 1 << 24)
    if b is None:
        return set()
    out = set()
    pre = chroot_prefix(pid)
    for line in b.decode(errors="replace").splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and "x" in parts[1] and parts[5].startswith("/"):
            out.add(in_view(parts[5].removesuffix(" (deleted)"), pre))
    return out


def root_prefix(pid: int) -> str:
    """'/proc/PID/root' when pid's root directory is not ours (a container's
    pivot_root, a chroot), '' when it is (or pid is gone): what a path in
    pid's maps is opened through to reach the file pid maps."""
    try:
        theirs, ours = os.stat(f"/proc/{pid}/root"), os.stat("/")
    except OSError:
        return ""
    same = (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)
    return "" if same else f"/proc/{pid}/root"


def chroot_prefix(pid: int) -> str:
    """The host path of pid's root when pid is chrooted inside gpufault's
    own mounts (`chroot DIR`, `unshare --mount` + chroot): /proc/PID/maps
    names its files from the reader's root, so they appear under this
    prefix there, while pid itself (and perf's mmap records) name them
    from its root. '' when its root is ours, or out of our reach (a
    container's pivot_root into mounts of its own: maps already name its
    files from its root)."""
    try:
        top = os.readlink(f"/proc/{pid}/root")
        theirs = os.stat(f"/proc/{pid}/root")
        if top in ("", "/") or not top.startswith("/") or top.endswith(" (deleted)"):
            return ""
        here = os.stat(top)
    except OSError:
        return ""
    # The same directory by the name readlink gave: a path nobody swapped.
    same = (here.st_dev, here.st_ino) == (theirs.st_dev, theirs.st_ino)
    return top.rstrip("/") if same else ""


def in_view(path: str, prefix: str) -> str:
    """A /proc/PID/maps path as pid sees it (chroot_prefix stripped)."""
    if prefix and path.startswith(prefix + "/"):
        return path[len(prefix) :]
    return path


def mapped_inodes(pid: int) -> dict[tuple[int, int], tuple[str, str]]:
    """(st_dev, st_ino) -> (path as pid sees it, a path that opens that very
    file), for every file pid maps executable: the file itself, whatever
    path it is reached by (a bind mount, a hard link, a container's root).
    From /proc/PID/map_files (the kernel's handle on the mapped file, no
    path walked in the target's root: root only), else the device and
    inode numbers /proc/PID/maps writes and the path through its root."""
    b = _read(f"/proc/{pid}/maps", 1 << 24)
    if b is None:
        return {}
    root, pre = root_prefix(pid), chroot_prefix(pid)
    out: dict[tuple[int, int], tuple[str, str]] = {}
    for line in b.decode(errors="replace").splitlines():
        parts = line.split(None, 5)
        if len(parts) != 6 or "x" not in parts[1] or not parts[5].startswith("/"):
            continue
        path = in_view(parts[5].strip().removesuffix(" (deleted)"), pre)
        handle = f"/proc/{pid}/map_files/{parts[0]}"
        try:
            st = os.stat(handle)
            key = (st.st_dev, st.st_ino)
        except OSError:
            major, _, minor = parts[3].partition(":")
            handle = root + path
            try:
                key = (os.makedev(int(major, 16), int(minor, 16)), int(parts[4]))
            except ValueError:
                continue
        out.setdefault(key, (path, handle))
    return out


def mapped_file(pid: int, path: str,
                inodes: dict[tuple[int, int], tuple[str, str]] | None = None) -> str:  # fmt: skip
    """Where to open the file pid maps at `path` (as it sees it): through
    its root when what lies there now is the inode mapped at that path;
    else (a file mounted over it, one swapped in since) the kernel's handle
    on the mapped file itself, /proc/PID/map_files/RANGE. A process whose
    root is ours: path (what lies there is the host's own business)."""
    root = root_prefix(pid)
    if not root:
        return path
    inodes = mapped_inodes(pid) if inodes is None else inodes
    try:
        st = os.stat(root + path)
        here = inodes.get((st.st_dev, st.st_ino))
        if here is not None and here[0] == path:
            return root + path
    except OSError:
        pass
    for seen, handle in inodes.values():
        if seen == path:
            return handle
    return root + path


def environ(pid: int) -> dict[str, str]:
    """pid's environment as it was at exec (what /proc keeps): a value
    read as data, never used to decide where gpufault reads or writes."""
    b = _read(f"/proc/{pid}/environ", _ENVIRON_MAX)
    if not b:
        return {}
    out = {}
    for item in b.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


def rank(pid: int) -> int | None:
    env = environ(pid)
    for var in RANK_VARIABLES:
        v = env.get(var, "")
        if v.isdigit():
            return int(v)
    return None
