"""A process's executable mappings kept current from attach on, the way
perf keeps them: PERF_RECORD_MMAP2 records of a dummy software event on
each of its threads (inherited by the threads it makes), one ring per
CPU (the kernel refuses to mmap an inherited per-task event: every child
would write one ring), read when the maps are needed and applied in time
order. The kernel writes a record
inside the mmap() call, so a library dlopen-ed a microsecond before a
fault is in the ring even when the process is killed right after it;
/proc/PID/maps is read once, at attach, never after the fact.

Why not /proc/PID/maps at ingest (as before): a target killed by its
fault (an injected SIGABRT) is gone by the time its fire record is read,
and a command target had not mapped libc yet when the maps were read at
attach: its frames in libc kept no module (`0x7f...`).

Only executable mappings are reported (attr.mmap without mmap_data): the
ones a frame may lie in. Exec (PERF_RECORD_COMM with the exec flag)
starts the list over.
"""

from __future__ import annotations

import ctypes as C
import mmap
import os
import struct
from pathlib import Path

from pyctl.symbols.maps import Mapping, Maps, mapping_base
from pyctl.targets.procfs import chroot_prefix, in_view, root_prefix

_NR_PERF_EVENT_OPEN = 298  # x86-64
PERF_TYPE_SOFTWARE, PERF_COUNT_SW_DUMMY = 1, 9
PERF_FLAG_FD_CLOEXEC = 1 << 3
PERF_EVENT_IOC_SET_OUTPUT = 0x2405
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_RECORD_LOST, PERF_RECORD_COMM, PERF_RECORD_MMAP2 = 2, 3, 10
PERF_RECORD_MISC_COMM_EXEC = 1 << 13
PERF_RECORD_MISC_MMAP_BUILD_ID = 1 << 14
# struct perf_event_attr flag bits
_INHERIT, _EXCL_KERNEL, _EXCL_HV, _MMAP, _COMM, _SAMPLE_ID_ALL, _MMAP2, _COMM_EXEC = (
    1, 5, 6, 8, 9, 18, 23, 24)  # fmt: skip
PERF_SAMPLE_TIME = 1 << 2  # with sample_id_all: each record ends with its time
RING_PAGES = 16  # 64 KiB per CPU: ~600 executable mappings between two reads
# Events are per (thread, CPU): a process with many threads at attach on
# a many-CPU host gets its main thread's (and those it makes) only.
MAX_FDS = 1024

_libc = C.CDLL(None, use_errno=True)
_libc.syscall.restype = C.c_long


class MapWatchError(OSError):
    pass


def _attr() -> bytes:
    flags = 0
    for b in (_INHERIT, _EXCL_KERNEL, _EXCL_HV, _MMAP, _COMM, _SAMPLE_ID_ALL, _MMAP2, _COMM_EXEC):
        flags |= 1 << b
    # type, size, config, sample_period, sample_type, read_format, flags;
    # the rest of PERF_ATTR_SIZE_VER5 (112 bytes) zero.
    head = struct.pack("<IIQQQQQ", PERF_TYPE_SOFTWARE, 112, PERF_COUNT_SW_DUMMY, 0,
                       PERF_SAMPLE_TIME, 0, flags)  # fmt: skip
    return head + bytes(112 - len(head))


def _open(tid: int, cpu: int) -> int:
    attr = C.create_string_buffer(_attr(), 112)
    fd = _libc.syscall(_NR_PERF_EVENT_OPEN, attr, C.c_int(tid), C.c_int(cpu), C.c_int(-1),
                       C.c_ulong(PERF_FLAG_FD_CLOEXEC))  # fmt: skip
    if fd < 0:
        e = C.get_errno()
        raise MapWatchError(e, f"perf_event_open on thread {tid}: {os.strerror(e)}")
    return int(fd)


def read_proc_maps(pid: int) -> list[Mapping] | None:
    """/proc/PID/maps with permissions; None if the process is gone."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    out = []
    # A chroot in our mounts: maps name its files from our root, perf's
    # records from its own; its own, as every reader stores them.
    pre = chroot_prefix(pid)
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        path = in_view(parts[5].strip(), pre) if len(parts) > 5 else ""
        major, _, minor = parts[3].partition(":")
        try:
            dev, ino = os.makedev(int(major, 16), int(minor, 16)), int(parts[4])
        except ValueError:
            dev = ino = 0
        out.append(Mapping(lo, hi, int(parts[2], 16), parts[1], path, dev, ino))
    return out


class MapWatch:
    """The mappings of one process: its /proc maps at start, then every
    executable mmap the kernel reports."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        # Its root when not ours (a container): where its paths are opened;
        # kept, since /proc/PID/root goes with the process.
        self.root = root_prefix(pid)
        self.fds: list[int] = []
        self.lost = 0  # records the ring dropped (then /proc is read, if it can be)
        self._maps: dict[int, Mapping] = {}  # lo -> mapping
        self._rings: list[mmap.mmap] = []
        self._snapshot: Maps | None = None
        self._file_maps: tuple[Maps, list[tuple[int, int, int, str]]] | None = None
        self._page = mmap.PAGESIZE
        # The events first, then the maps: a mapping made in between is in both.
        try:
            tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        except OSError as e:
            raise MapWatchError(e.errno or 0, f"pid {pid}: {e.strerror}") from None
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        cpus = list(range(os.cpu_count() or 1)) if not cpus else cpus
        if len(tids) * len(cpus) > MAX_FDS:
            tids = [pid]
        try:
            for cpu in cpus:
                leader = -1
                for tid in tids:
                    try:
                        fd = _open(tid, cpu)
                    except MapWatchError:
                        if tid == pid:
                            raise
                        continue  # a thread that exited meanwhile
                    if leader < 0:
                        self._rings.append(mmap.mmap(fd, (1 + RING_PAGES) * self._page))
                        leader = fd
                    elif _libc.ioctl(fd, PERF_EVENT_IOC_SET_OUTPUT, leader):
                        os.close(fd)
                        continue
                    self.fds.append(fd)
        except BaseException:
            self.close()
            raise
        for m in read_proc_maps(pid) or []:
            self._maps[m.lo] = m

    def close(self) -> None:
        for r in self._rings:
            r.close()
        self._rings = []
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def update(self) -> None:
        """Apply what the kernel reported since the last call, oldest first."""
        recs: list[tuple[int, int, int, bytes]] = []
        for r in self._rings:
            recs.extend(self._drain(r))
        recs.sort(key=lambda x: x[0])
        if recs:
            self._snapshot = None
        for _t, typ, misc, rec in recs:
            if typ == PERF_RECORD_MMAP2:
                self._mmap2(rec, misc)
            elif typ == PERF_RECORD_COMM and misc & PERF_RECORD_MISC_COMM_EXEC:
                pid, tid = struct.unpack_from("<II", rec, 8)
                if pid == self.pid and pid == tid:
                    self._maps.clear()  # a new image: the old mappings are gone
            elif typ == PERF_RECORD_LOST:
                self.lost += struct.unpack_from("<Q", rec, 16)[0]
        if self.lost:
            fresh = read_proc_maps(self.pid)
            if fresh is not None:
                self._maps = {m.lo: m for m in fresh}
                self._snapshot = None
                self.lost = 0

    def _drain(self, r: mmap.mmap) -> list[tuple[int, int, int, bytes]]:
        """(time, type, misc, record) of every record in one CPU's ring."""
        head = struct.unpack_from("<Q", r, 1024)[0]
        tail = struct.unpack_from("<Q", r, 1032)[0]
        size = RING_PAGES * self._page
        out = []
        while tail < head:
            off = tail % size
            typ, misc, ln = struct.unpack("<IHH", self._bytes(r, self._page, off, 8, size))
            if ln < 16:
                break
            rec = self._bytes(r, self._page, off, ln, size)
            out.append((struct.unpack_from("<Q", rec, ln - 8)[0], typ, misc, rec))
            tail += ln
        struct.pack_into("<Q", r, 1032, tail)
        return out

    @staticmethod
    def _bytes(r: mmap.mmap, base: int, off: int, n: int, size: int) -> bytes:
        if off + n <= size:
            return r[base + off : base + off + n]
        first = size - off
        return r[base + off : base + size] + r[base : base + n - first]

    def _mmap2(self, rec: bytes, misc: int) -> None:
        pid, _tid, addr, ln, pgoff = struct.unpack_from("<IIQQQ", rec, 8)
        if pid != self.pid:
            return  # a child process's (inherit follows forks too)
        prot = struct.unpack_from("<I", rec, 64)[0]
        name = rec[72:].split(b"\0", 1)[0].decode(errors="replace")
        dev = ino = 0
        if not misc & PERF_RECORD_MISC_MMAP_BUILD_ID:  # maj, min, ino; else a build-id
            major, minor, ino = struct.unpack_from("<IIQ", rec, 40)
            dev = os.makedev(major, minor)
        new = Mapping(addr, addr + ln, pgoff, "r-xp" if prot & 4 else "r--p", name, dev, ino)
        # The new mapping replaces whatever it overlaps (MAP_FIXED over a reservation).
        for lo in [lo for lo, m in self._maps.items() if m.lo < new.hi and new.lo < m.hi]:
            del self._maps[lo]
        self._maps[new.lo] = new

    def maps(self) -> Maps:
        """The mappings now; the same object while nothing changed (it
        memoizes the modules' unwind tables and load bases)."""
        self.update()
        if self._snapshot is None:
            self._snapshot = Maps(list(self._maps.values()), self.root)
        return self._snapshot

    def file_maps(self) -> list[tuple[int, int, int, str]]:
        """(lo, hi, offset, path) of the file mappings: what
        pyctl/symbols/symbolize.py's Symbolizer takes (offer()). The
        offset is where the mapping's lo sits from the file's load base
        (lo - offset is the base): a mapping perf reported is the
        executable one alone, and its file offset is not its vaddr where
        the file's segments differ (a wheel's .so), so it is corrected by
        the segments' difference."""
        snap = self.maps()  # the same object while nothing changed: computed once
        if self._file_maps is None or self._file_maps[0] is not snap:
            self._file_maps = (snap, sorted(
                (m.lo, m.hi, m.lo - mapping_base(m, opened=snap.opened(m.path)), m.path)
                for m in self._maps.values() if m.path.startswith("/")))  # fmt: skip
        return self._file_maps[1]
