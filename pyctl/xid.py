"""Record NVIDIA Xids (nvidia:nvidia_dev_xid) and link them to faults.

The driver's tracepoint carries the device (PCI name, e.g. 0000:18:00.0),
the Xid number and the message. The monitor attaches bpf/xid.bpf.c's raw
tracepoint program by name (no tracefs needed; the arguments are the
driver's TP_PROTO, the device name read with CO-RE from vmlinux's struct
pci_dev). Where the kernel refuses that, or for a stand-in tracepoint in
tests, the record's layout is read from the tracepoint's `format` file
(tracefs, mounted if need be) and handed to the classic program as .rodata
before load. Each Xid becomes a row of the
`xids` table; its fault is the newest fault fired in a process that has
that GPU open (/dev/nvidiaN, N from /proc/driver/nvidia/gpus/BDF) no
longer than `window_s` before the Xid (rule `xid-on-device-of-faulted-
process`), else the row keeps a NULL fault_id (rule `unattributed`).

Beside an Engine, the monitor writes through the engine's connection, so a
run's rows have one writer and each Xid lands in that run::

    mon = XidMonitor.beside(engine)   # after engine.start(), on the engine's thread
    mon.start()            # XidError if the tracepoint is absent
    ... mon.note_fault(row) from Engine.on_fire; mon.poll(0) after engine.poll()
    mon.close()            # before engine.close(): the run row is ended last

Alone (no engine), it opens its own connection at the first Xid and closes
it in close()::

    mon = XidMonitor(db_path)
"""

from __future__ import annotations

import ctypes as C
import errno
import os
import re
import select
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyctl import tracefs as _tf
from pyctl.bpf.libbpf import BpfError, Object, lib, map_lookup
from pyctl.bpf.ringbuf import RingReader
from pyctl.evidence import store
from pyctl.exceptions import MissingPrerequisite

XID_OBJ = Path(__file__).resolve().parent / "data" / "xid.bpf.o"
CATEGORY, EVENT = "nvidia", "nvidia_dev_xid"
DEV_LEN, MSG_LEN = 32, 128
EVENT_FMT = struct.Struct(f"=QQII{DEV_LEN}s{MSG_LEN}s")  # struct xid_event
RING_BYTES = 64 * 1024
DEFAULT_WINDOW_S = 60.0


class XidError(MissingPrerequisite):
    """One line for the user: what is missing and what to do."""


@dataclass(frozen=True)
class Field:
    name: str
    offset: int
    size: int
    data_loc: bool  # a __data_loc string: a u32 (len << 16 | offset) at `offset`


_FIELD = re.compile(r"field:(?P<decl>[^;]+);\s*offset:(?P<off>\d+);\s*size:(?P<size>\d+);")


def parse_format(text: str) -> dict[str, Field]:
    """The fields of a tracepoint `format` file, by name."""
    out: dict[str, Field] = {}
    for m in _FIELD.finditer(text):
        decl = m.group("decl").strip()
        name = re.sub(r"\[.*?\]", "", decl.split()[-1])
        out[name] = Field(name, int(m.group("off")), int(m.group("size")),
                          decl.startswith("__data_loc"))
    return out


@dataclass(frozen=True)
class Layout:
    """Where bpf/xid.bpf.c finds dev, error_code and msg in the record."""

    dev: Field
    code: Field
    msg: Field | None

    @classmethod
    def from_format(cls, text: str, dev: str = "dev", code: str = "error_code",
                    msg: str | None = "msg") -> Layout:
        f = parse_format(text)
        missing = [n for n in (dev, code, msg) if n and n not in f]
        if missing:
            raise XidError(f"tracepoint format lacks field(s) {', '.join(missing)}: "
                           "a driver with another nvidia_dev_xid layout; report it")
        if f[code].size not in (1, 2, 4, 8):
            raise XidError(f"field {code} has size {f[code].size}, not 1, 2, 4 or 8")
        for n in (dev, msg):
            if n and not f[n].data_loc and f[n].size == 0:
                raise XidError(f"field {n} is neither a string nor a char array")
        return cls(f[dev], f[code], f[msg] if msg else None)

    def rodata(self) -> dict[str, int]:
        m = self.msg
        return {"off_dev": self.dev.offset, "dev_loc": int(self.dev.data_loc),
                "off_code": self.code.offset, "size_code": self.code.size,
                "off_msg": m.offset if m else 0, "msg_loc": int(m.data_loc) if m else 0,
                "has_msg": int(m is not None)}


def tracefs() -> str | None:
    return _tf.find()


def format_path(category: str = CATEGORY, event: str = EVENT) -> Path | None:
    tf = tracefs()
    if tf is None:
        return None
    p = Path(tf) / "events" / category / event / "format"
    return p if p.exists() else None


def _minor_of_bdf(bdf: str) -> int | None:
    """/proc/driver/nvidia/gpus/BDF/information has 'Device Minor: N'."""
    try:
        text = Path(f"/proc/driver/nvidia/gpus/{bdf}/information").read_text()
    except OSError:
        return None
    m = re.search(r"Device Minor:\s*(\d+)", text)
    return int(m.group(1)) if m else None


def nvidia_minors_of(pid: int) -> set[int]:
    """The /dev/nvidiaN files a process has open."""
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        m = re.fullmatch(r"/dev/nvidia(\d+)", target)
        if m:
            out.add(int(m.group(1)))
    return out


def _str(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode(errors="replace")


@dataclass
class Xid:
    ts_ns: int
    error_code: int
    pid: int
    tid: int
    dev: str
    msg: str

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> Xid:
        ts, code, pid, tid, dev, msg = EVENT_FMT.unpack_from(bytes(data[: EVENT_FMT.size]))
        return cls(ts, code, pid, tid, _str(dev), _str(msg))


def _attach_raw(obj: Object, event: str) -> int:
    """Attach gf_xid_raw of a loaded object to raw tracepoint `event` (by
    name, through bpf(2): no tracefs). 0, or the errno (ENOENT: absent)."""
    fn = lib().bpf_program__attach_raw_tracepoint
    fn.restype = C.c_void_p
    fn.argtypes = [C.c_void_p, C.c_char_p]
    C.set_errno(0)
    link = fn(obj.program("gf_xid_raw"), event.encode())
    if not link:
        return C.get_errno() or errno.EINVAL
    obj.links.append(int(link))
    return 0


def raw_tracepoint_attaches(event: str = EVENT) -> bool:
    """A trial: does bpf/xid.bpf.c's raw tracepoint program attach to the
    driver's tracepoint (no tracefs)? Loaded, attached, closed at once."""
    if not XID_OBJ.exists():
        return False
    obj = Object(XID_OBJ)
    try:
        obj.set_autoload("gf_xid", False)
        obj.load()
        return _attach_raw(obj, event) == 0
    except BpfError:
        return False
    finally:
        obj.close()


class XidMonitor:
    """Loads bpf/xid.bpf.o, attaches it, stores and links each Xid."""

    def __init__(self, db_path: str | os.PathLike[str] = store.DEFAULT_DB, *,
                 run_id: str | None = None, db: Any = None,
                 window_s: float = DEFAULT_WINDOW_S,
                 category: str = CATEGORY, event: str = EVENT,
                 fields: tuple[str, str, str | None] = ("dev", "error_code", "msg"),
                 minor_of: Any = None):
        """db: an open store (the engine's) to write through; the monitor
        then opens and closes no connection of its own, and must be polled
        from the thread that creates it (the one writing through db).
        Without it, db_path is opened at the first Xid and closed by close()."""
        self.db_path = db_path
        self.run_id = run_id
        self.window_ns = int(window_s * 1e9)
        self.category, self.event = category, event
        self.fields = fields
        # BDF -> /dev/nvidiaN minor; replaceable where no NVIDIA driver runs.
        self.minor_of = minor_of or _minor_of_bdf
        self.obj: Object | None = None
        self.ring: RingReader | None = None
        self.db: Any = db
        self.owns_db = db is None
        # A borrowed connection has one writer thread: the engine's.
        self._writer = None if db is None else threading.get_ident()
        self._table_ready = False
        self._ep: select.epoll | None = None
        self._pid_minors: dict[int, set[int]] = {}
        self.seen: list[Xid] = []
        self.mode = ""  # "raw" (no tracefs) or "format" once started

    @classmethod
    def beside(cls, engine: Any, **kw: Any) -> XidMonitor:
        """A monitor that writes through a started engine's connection, into
        its run. Call it on the thread that polls the engine."""
        if engine.db is None or not engine.run_id:
            raise RuntimeError("start the engine before its Xid monitor")
        return cls(engine.db_path, run_id=engine.run_id, db=engine.db, **kw)

    # ---- set-up -------------------------------------------------------
    def start(self) -> None:
        """Check, load, attach; on failure nothing stays loaded or written.

        The driver's own tracepoint goes through the raw program (no
        tracefs); a stand-in (another category/event or field names) or a
        kernel that refuses the raw attach goes through the format file."""
        if os.geteuid() != 0:
            raise XidError("recording Xids needs root (BPF): run with sudo")
        if not XID_OBJ.exists():
            raise XidError(f"{XID_OBJ} missing: run `make build` first")
        standin = (self.category, self.event, self.fields) != (
            CATEGORY, EVENT, ("dev", "error_code", "msg"))
        if not standin and self._start_raw():
            return
        self._start_format()

    def _absent(self) -> XidError:
        return XidError(f"tracepoint {self.category}:{self.event} absent: Xids need the "
                        "NVIDIA kernel module (open, >= 575) loaded; see gpufault doctor")

    def _start_raw(self) -> bool:
        """True when attached; False when the format path should be tried."""
        obj = self._object()
        try:
            obj.set_autoload("gf_xid", False)
            obj.load()
            e = _attach_raw(obj, self.event)
            if e == errno.ENOENT:
                raise self._absent()
            if e:
                raise BpfError(e, f"raw tracepoint {self.event}: {os.strerror(e)}")
        except XidError:
            obj.close()
            raise
        except BpfError:
            obj.close()
            return False
        self._started(obj, "raw")
        return True

    def _start_format(self) -> None:
        fmt = format_path(self.category, self.event)
        if fmt is None and tracefs() is None:
            try:
                _tf.ensure(f"the {self.category}:{self.event} format file")
            except _tf.TracefsError as e:
                raise XidError(str(e)) from None
            fmt = format_path(self.category, self.event)
        if fmt is None:
            raise self._absent()
        layout = Layout.from_format(fmt.read_text(), *self.fields)
        obj = self._object()
        try:
            obj.set_autoload("gf_xid_raw", False)
            obj.set_rodata({k: ("=I", v) for k, v in layout.rodata().items()})
            obj.load()
            self._attach(obj)
        except BpfError as e:
            obj.close()
            raise XidError(f"{e}: see `gpufault doctor`") from None
        self._started(obj, "format")

    def _object(self) -> Object:
        try:
            return Object(XID_OBJ)
        except BpfError as e:
            raise XidError(str(e)) from None

    def _started(self, obj: Object, mode: str) -> None:
        self.obj = obj
        self.mode = mode
        self.ring = RingReader(obj.map_fd("xids"), RING_BYTES)
        self._ep = select.epoll()
        self._ep.register(self.ring.fd, select.EPOLLIN)

    def _open_db(self) -> Any:
        """The store at the first Xid (a run with none writes nothing): the
        borrowed connection, else our own, opened now."""
        if self.db is None:
            if not self.owns_db:
                raise RuntimeError("XidMonitor closed: the engine's connection is not ours")
            self.db = store.open_db(self.db_path)
        elif self._writer is not None and threading.get_ident() != self._writer:
            # Two threads on one connection would commit each other's batches.
            raise RuntimeError("XidMonitor polled from another thread than the engine's")
        if not self._table_ready:
            # open_db made every table; a borrowed connection may not have
            # come through it (the engine's tests).
            store.ensure_schema(self.db)
            self._table_ready = True
        return self.db

    def _attach(self, obj: Object) -> None:
        lb = lib()
        fn = lb.bpf_program__attach_tracepoint
        fn.restype = C.c_void_p
        fn.argtypes = [C.c_void_p, C.c_char_p, C.c_char_p]
        C.set_errno(0)
        link = fn(obj.program("gf_xid"), self.category.encode(), self.event.encode())
        if not link:
            e = C.get_errno()
            raise BpfError(e, f"cannot attach {self.category}:{self.event}: {os.strerror(e)}")
        obj.links.append(int(link))

    # ---- linking ------------------------------------------------------
    def note_pid(self, pid: int) -> None:
        """Remember which GPUs a process has open, now (at attach: a target
        that a fault kills at once, an abort on a dead CUDA context, is gone
        before its fire is read, and with it /proc/PID/fd)."""
        minors = nvidia_minors_of(pid)
        if minors or pid not in self._pid_minors:
            self._pid_minors[pid] = minors

    def note_fault(self, row: dict[str, Any]) -> None:
        """Remember which GPUs a faulted process has open (call from on_fire:
        the process may be gone by the time its Xid is read)."""
        pid = int(row["pid"])
        if not self._pid_minors.get(pid):
            self.note_pid(pid)

    def _link(self, x: Xid) -> tuple[str | None, str]:
        minor = self.minor_of(x.dev)
        sql = ("SELECT fault_id, pid FROM faults WHERE ts_ns <= ? AND ts_ns >= ?"
               + (" AND run_id = ?" if self.run_id else "") + " ORDER BY ts_ns DESC")
        args: tuple[Any, ...] = (x.ts_ns, x.ts_ns - self.window_ns)
        if self.run_id:
            args += (self.run_id,)
        try:
            rows = self.db.conn.execute(sql, args).fetchall()
        except Exception:  # noqa: BLE001 - no faults table yet: nothing to link
            rows = []
        for fid, pid in rows:
            minors = self._pid_minors.get(pid)
            if minors is None:
                minors = self._pid_minors[pid] = nvidia_minors_of(pid)
            if minor is not None and minor in minors:
                return fid, "xid-on-device-of-faulted-process"
        return None, "unattributed"

    # ---- the loop -----------------------------------------------------
    def poll(self, timeout: float = 0.05) -> list[Xid]:
        assert self._ep is not None
        self._ep.poll(timeout)
        return self.drain()

    def drain(self) -> list[Xid]:
        if self.ring is None:
            return []
        new = [Xid.unpack(r) for r in self.ring.records()]
        if not new:
            return []
        self.record(new)
        return new

    def record(self, new: list[Xid]) -> None:
        """Link a batch of Xids and insert it: one transaction, like the
        engine's batches (a killed controller leaves no half batch)."""
        db = self._open_db()
        rows = []
        for x in new:
            fid, rule = self._link(x)
            rows.append({"fault_id": fid, "run_id": self.run_id, "dev": x.dev,
                         "error_code": x.error_code, "msg": x.msg, "ts_ns": x.ts_ns,
                         "pid": x.pid, "tid": x.tid, "rule": rule})
        with db.conn:
            db["xids"].insert_all(rows)
        self.seen.extend(new)

    def lost(self) -> int:
        if self.obj is None:
            return 0
        v = C.c_uint64()
        map_lookup(self.obj.map_fd("xid_lost"), C.c_uint32(0), v)
        return v.value

    def close(self) -> None:
        """Detach, read what is left, close our own connection (a borrowed
        one stays open for its engine). Idempotent."""
        if self.obj is not None:
            self.obj.detach_all()
            try:
                self.drain()
            finally:
                if self.ring is not None:
                    self.ring.close()
                    self.ring = None
                if self._ep is not None:
                    self._ep.close()
                    self._ep = None
                self.obj.close()
                self.obj = None
        if self.db is not None and self.owns_db:
            self.db.close()
        self.db = None
