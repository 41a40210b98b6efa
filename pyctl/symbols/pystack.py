"""A CPython thread's Python stack, read from the target's memory the way
py-spy and Austin do: _PyRuntime (a symbol of libpython or of the python
executable, found with pyctl/elf.py) -> interpreters -> thread states ->
the one whose native_thread_id is the thread's TID -> its current frame
chain (3.11/3.12: tstate->cframe->current_frame; 3.13: tstate->current_frame)
-> each _PyInterpreterFrame's code object: qualname, filename, and the line
from the frame's instruction pointer and co_linetable.

Offsets: 3.13 carries _Py_DebugOffsets at the start of _PyRuntime (cookie
"xdebugpy"), read from the target itself. 3.11 and 3.12 have none: their
offsets below were printed by tools/pyoffsets.c (offsetof over the
interpreters' own internal headers, 3.11.7 and 3.12.1), and
tests/test_pystack.py recompiles it against each installed interpreter and
compares. Other versions are refused in one line (PyStack.error).

Reads go through /proc/PID/mem (one descriptor per process). A thread that
is running while it is read can give a torn chain: every pointer is
bounded, every string checked, and a frame whose code object does not read
as one ends the walk with the reason, never with garbage.
"""

from __future__ import annotations

import os
import re
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pyctl import elf
from pyctl.targets.procfs import chroot_prefix, in_view, mapped_file, ns_tid

MAX_FRAMES = 256
MAX_STR = 1024
MAX_LINETABLE = 1 << 20

# tools/pyoffsets.c's output for 3.11.7 and 3.12.1 (same names).
OFFSETS: dict[tuple[int, int], dict[str, int]] = {
    (3, 11): {
        "runtime_interpreters_head": 40, "interp_next": 0, "interp_threads_head": 16,
        "tstate_next": 8, "tstate_native_thread_id": 160, "tstate_cframe": 56,
        "cframe_current_frame": 8, "frame_code": 32, "frame_previous": 48,
        "frame_prev_instr": 56, "frame_owner": 69, "frame_is_entry": 68,
        "code_filename": 112, "code_name": 120,
        "code_qualname": 128, "code_linetable": 136, "code_firstlineno": 72,
        "code_code_adaptive": 184, "unicode_state": 32, "unicode_length": 16,
        "unicode_ascii_size": 48, "unicode_compact_size": 72, "bytes_size": 16,
        "bytes_sval": 32,
    },
    (3, 12): {
        "runtime_interpreters_head": 40, "interp_next": 0, "interp_threads_head": 72,
        "tstate_next": 8, "tstate_native_thread_id": 144, "tstate_cframe": 56,
        "cframe_current_frame": 0, "frame_code": 0, "frame_previous": 8,
        "frame_prev_instr": 56, "frame_owner": 70, "code_filename": 112, "code_name": 120,
        "code_qualname": 128, "code_linetable": 136, "code_firstlineno": 68,
        "code_code_adaptive": 192, "unicode_state": 32, "unicode_length": 16,
        "unicode_ascii_size": 40, "unicode_compact_size": 56, "bytes_size": 16,
        "bytes_sval": 32,
    },
}  # fmt: skip

# 3.13's _Py_DebugOffsets (Include/internal/pycore_runtime.h, 3.13.0) as
# u64 word indices: name -> word. 3.14 changed the layout: refused.
_DEBUG_WORDS_313 = {
    "version": 1, "runtime_interpreters_head": 5, "interp_next": 8,
    "interp_threads_head": 9, "tstate_next": 21, "tstate_current_frame": 23,
    "tstate_native_thread_id": 25, "frame_previous": 29, "frame_code": 30,
    "frame_prev_instr": 31, "frame_owner": 33, "code_filename": 35, "code_name": 36,
    "code_qualname": 37, "code_linetable": 38, "code_firstlineno": 39,
    "code_code_adaptive": 43, "bytes_size": 65, "bytes_sval": 66, "unicode_state": 68,
    "unicode_length": 69, "unicode_ascii_size": 70,
}  # fmt: skip
_DEBUG_COOKIE = b"xdebugpy"
_DEBUG_BYTES = 73 * 8

FRAME_OWNED_BY_CSTACK = 3  # 3.12+: the C stack's shim frame, not Python's
TP_NAME = 24  # PyTypeObject.tp_name after PyVarObject's head (every version here)

SUPPORTED = "3.11, 3.12, 3.13"


class PyStackError(Exception):
    """Why the Python stack could not be read (one line)."""


@dataclass
class PyFrame:
    function: str  # co_qualname
    file: str  # co_filename
    line: int | None  # None: the instruction has no line (co_linetable)
    # The outermost frame of one _PyEval_EvalFrameDefault call: the eval
    # loop was entered from C for it (3.11: is_entry; 3.12+: the C stack's
    # shim frame follows it). Where Python frames join the native stack.
    entry: bool = False


@dataclass
class PyStack:
    version: str = ""  # "3.11.7"
    frames: list[PyFrame] = field(default_factory=list)  # innermost first
    error: str = ""  # set when the stack could not be read (frames may be partial)
    read_ns: int = 0  # CLOCK_MONOTONIC when it was read
    tid: int = 0

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "version": self.version,
            "tid": self.tid,
            "read_ns": self.read_ns,
            "frames": [[f.function, f.file, f.line, f.entry] for f in self.frames],
        }
        if self.error:
            out["error"] = self.error
        return out


class _Mem:
    def __init__(self, pid: int) -> None:
        # lazy: pyctl.heldcalls (ctypes) only once a Python stack is read
        from pyctl import heldcalls

        self._pread = heldcalls.pread
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read(self, addr: int, n: int) -> bytes:
        if addr <= 0 or addr >= 1 << 47:
            raise PyStackError(f"pointer {addr:#x} is not a user address")
        try:
            # Keeping the GIL (pyctl/heldcalls.py): the copilot reads a
            # held thread's stack through this, dozens of reads a fire.
            b = self._pread(self.fd, n, addr)
        except OSError as e:
            raise PyStackError(f"read at {addr:#x}: {e.strerror or e}") from None
        if not b:  # the mm is gone: the process exited (or exec'd) since
            raise PyStackError("the process's memory is gone (it exited or exec'd)")
        if len(b) != n:
            raise PyStackError(f"short read at {addr:#x}")
        return b

    def u64(self, addr: int) -> int:
        return int(struct.unpack("<Q", self.read(addr, 8))[0])


def _py_paths(maps: Iterable[tuple[int, int, str]]) -> list[tuple[str, int]]:
    """(path, load base) of each mapped file that may hold _PyRuntime:
    libpython3.* or a python3* executable. maps: (lo, file offset, path)."""
    firsts: dict[str, tuple[int, int]] = {}
    for lo, off, path in maps:
        base = os.path.basename(path)
        if not path.startswith("/") or not (
            base.startswith("libpython3") or re.match(r"python3[\d.]*$", base)
        ):
            continue
        if path not in firsts or lo - off < firsts[path][0] - firsts[path][1]:
            firsts[path] = (lo, off)
    return [(p, lo - off) for p, (lo, off) in firsts.items()]


def interpreter_key(maps: Iterable[tuple[int, int, str]]) -> tuple[tuple[str, int], ...]:
    """What a process's interpreter is located by: its candidate files and
    their load bases. Another key (an exec) needs another Reader."""
    return tuple(sorted(_py_paths(maps)))


@dataclass
class _Runtime:
    addr: int
    version: tuple[int, int, int]
    off: dict[str, int]


_SYMS: dict[tuple[int, int, float], dict[str, int]] = {}


def _find_symbols(path: str) -> dict[str, int]:
    """_PyRuntime's and Py_Version's st_value in path (.dynsym, else
    .symtab), relative to the load base; read once per file (~20 ms for
    libpython's tables)."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_mtime)
    if key not in _SYMS:
        _SYMS[key] = _read_symbols(path)
    return _SYMS[key]


def _read_symbols(path: str) -> dict[str, int]:
    want = {"_PyRuntime", "Py_Version"}
    got: dict[str, int] = {}
    with elf.ElfFile.open(path) as f:
        first = f.first_load
        for table in (".dynsym", ".symtab"):
            if f.section(table) is None:
                continue
            for s in f.symbols(table):
                if s.name in want and s.value and s.name not in got:
                    got[s.name] = s.value - first
            if "_PyRuntime" in got:
                break
    return got


def _version_from_path(path: str) -> str:
    m = re.search(r"python(3\.\d+)", os.path.basename(path))
    return m.group(1) if m else "3.?"


class Reader:
    """One process's interpreter: located once, then read per thread."""

    def __init__(self, pid: int, maps: Iterable[tuple[int, int, str]] | None = None) -> None:
        self.pid = pid
        self.mem = _Mem(pid)
        self.runtime: _Runtime | None = None
        self.not_python = False
        self.error = ""
        self._codes: dict[
            tuple[int, bytes, bytes, bytes, bytes],
            tuple[str, str, int, bytes, dict[int, tuple[int | None]]],
        ] = {}
        self._ts_of: dict[int, int] = {}  # tid -> its PyThreadState (_tstate)
        self.key: tuple[tuple[str, int], ...] = ()
        self.exe = exe_id(pid)
        try:
            self.in_ns = (
                os.stat(f"/proc/{pid}/ns/pid").st_ino != os.stat("/proc/self/ns/pid").st_ino
            )
        except OSError:
            self.in_ns = False
        try:
            got = list(maps) if maps is not None else _proc_maps(pid)
            self.key = interpreter_key(got)
            self._locate(got)
        except PyStackError as e:
            self.error = str(e)
        except OSError as e:
            self.error = f"cannot read the interpreter: {e.strerror or e}"

    def close(self) -> None:
        self.mem.close()

    def _locate(self, maps: Iterable[tuple[int, int, str]]) -> None:
        pre = chroot_prefix(self.pid)
        for path, base in _py_paths(maps):
            # The interpreter the process maps, through its root when it is
            # not ours (a container's libpython may be at no host path, or
            # be another build there); a chroot's maps name it from ours.
            syms = _find_symbols(mapped_file(self.pid, in_view(path, pre)))
            if "_PyRuntime" not in syms:
                continue
            rt = base + syms["_PyRuntime"]
            if "Py_Version" not in syms:
                raise PyStackError(
                    f"python frames: unsupported CPython {_version_from_path(path)} "
                    f"(supported: {SUPPORTED})"
                )
            hexv = self.mem.u64(base + syms["Py_Version"]) & 0xFFFFFFFF
            ver = (hexv >> 24, hexv >> 16 & 0xFF, hexv >> 8 & 0xFF)
            if ver[:2] in OFFSETS:
                self.runtime = _Runtime(rt, ver, OFFSETS[ver[:2]])
            elif ver[:2] == (3, 13):
                head = self.mem.read(rt, _DEBUG_BYTES)
                if head[:8] != _DEBUG_COOKIE:
                    raise PyStackError("python frames: CPython 3.13 without _Py_DebugOffsets")
                words = struct.unpack(f"<{_DEBUG_BYTES // 8}Q", head)
                if words[2]:
                    raise PyStackError(
                        "python frames: unsupported CPython 3.13 free-threaded build"
                    )
                off = {k: words[i] for k, i in _DEBUG_WORDS_313.items()}
                self.runtime = _Runtime(rt, ver, off)
            else:
                raise PyStackError(
                    f"python frames: unsupported CPython {ver[0]}.{ver[1]} (supported: {SUPPORTED})"
                )
            return
        self.not_python = True

    # ---- per thread ----

    def thread(self, tid: int) -> PyStack | None:
        """The Python stack of tid; None when the process runs no CPython
        or tid has no thread state (a thread Python never ran on)."""
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        if self.not_python:
            return None
        rt = self.runtime
        if rt is None:
            return PyStack(error=self.error, read_ns=now, tid=tid)
        st = PyStack(version=".".join(map(str, rt.version)), read_ns=now, tid=tid)
        try:
            # CPython keeps gettid() as its own PID namespace numbers it: a
            # container's thread is found by its tid there, not the host's.
            own = ns_tid(self.pid, tid) if self.in_ns else tid
            ts = self._tstate(rt, own if own is not None else tid)
            if ts is None:
                return None
            self._frames(rt, ts, st)
        except PyStackError as e:
            st.error = str(e)
        return st

    def _tstate(self, rt: _Runtime, tid: int) -> int | None:
        o = rt.off
        # A thread's state stays where it is while the thread lives: one
        # read confirms the last one found (the walk is two reads a thread).
        # A state freed and reused since reads as another tid (or not at
        # all): walk. One freed and left as it was still reads its tid, but
        # its thread is gone: no fire names that tid until the kernel
        # hands it out again, after a wrap of the pid space.
        ts = self._ts_of.get(tid)
        if ts:
            try:
                if self.mem.u64(ts + o["tstate_native_thread_id"]) == tid:
                    return ts
            except PyStackError:
                pass
            del self._ts_of[tid]
        found = self._walk_tstates(rt, tid)
        if found is not None:
            if len(self._ts_of) > 4096:
                self._ts_of.clear()
            self._ts_of[tid] = found
        return found

    def _walk_tstates(self, rt: _Runtime, tid: int) -> int | None:
        o = rt.off
        interp = self.mem.u64(rt.addr + o["runtime_interpreters_head"])
        for _ in range(64):
            if not interp:
                return None
            ts = self.mem.u64(interp + o["interp_threads_head"])
            for _ in range(4096):
                if not ts:
                    break
                if self.mem.u64(ts + o["tstate_native_thread_id"]) == tid:
                    return ts
                ts = self.mem.u64(ts + o["tstate_next"])
            interp = self.mem.u64(interp + o["interp_next"])
        return None

    def _frames(self, rt: _Runtime, ts: int, st: PyStack) -> None:
        o = rt.off
        if "tstate_current_frame" in o:
            frame = self.mem.u64(ts + o["tstate_current_frame"])
        else:
            cframe = self.mem.u64(ts + o["tstate_cframe"])
            frame = self.mem.u64(cframe + o["cframe_current_frame"]) if cframe else 0
        seen: set[int] = set()
        fsize = max(o["frame_owner"], o["frame_previous"], o["frame_code"],
                    o["frame_prev_instr"]) + 8  # fmt: skip
        while frame and len(st.frames) < MAX_FRAMES:
            if frame in seen:
                raise PyStackError("the frame chain loops (read while the thread ran)")
            seen.add(frame)
            # One read per frame: the fields it needs lie in its first bytes.
            fb = self.mem.read(frame, fsize)
            owner = fb[o["frame_owner"]]
            code = _u64(fb, o["frame_code"])
            if rt.version[:2] >= (3, 12) and owner == FRAME_OWNED_BY_CSTACK:
                if st.frames:
                    st.frames[-1].entry = True
            else:
                pf = self._code_frame(rt, code, _u64(fb, o["frame_prev_instr"]))
                if "frame_is_entry" in o:
                    pf.entry = bool(fb[o["frame_is_entry"]])
                st.frames.append(pf)
            frame = _u64(fb, o["frame_previous"])
        if st.frames and not frame:
            st.frames[-1].entry = True  # the outermost: entered from C

    def _code_frame(self, rt: _Runtime, code: int, ip: int) -> PyFrame:
        o = rt.off
        # The code object's head in one read; what it names (type, strings,
        # line table) read once per code object and kept while the head's
        # pointers stay the same (a code object freed and another made at
        # its address has other strings).
        head = self.mem.read(code, o["code_code_adaptive"])
        key = (code, head[8:16], head[o["code_qualname"] : o["code_qualname"] + 8],
               head[o["code_filename"] : o["code_filename"] + 8],
               head[o["code_linetable"] : o["code_linetable"] + 8])  # fmt: skip
        hit = self._codes.get(key)
        if hit is not None and (known := hit[4].get(ip)) is not None:
            return PyFrame(hit[0], hit[1], known[0])
        if hit is None:
            if self._cstr(_u64(head, 8) + TP_NAME, deref=True) != "code":
                raise PyStackError(f"{code:#x} is no code object (read while the thread ran)")
            name = self._unicode(rt, _u64(head, o["code_qualname"]))
            fname = self._unicode(rt, _u64(head, o["code_filename"]))
            first = struct.unpack_from("<i", head, o["code_firstlineno"])[0]
            table = self._bytes(rt, _u64(head, o["code_linetable"]))
            hit = self._codes[key] = (name, fname, first, table, {})
            if len(self._codes) > 65536:
                self._codes.clear()
        name, fname, first, table, lines = hit
        # Code units (2 bytes) from the first instruction; 3.11/3.12's
        # prev_instr is the last one executed, 3.13's instr_ptr the current.
        unit = (ip - (code + o["code_code_adaptive"])) // 2
        # Kept per instruction: the walk of the line table was half of a
        # stack's read (issue 26: the copilot reads it with the thread held).
        line = line_of(table, first, unit)
        if len(lines) < 4096:
            lines[ip] = (line,)
        return PyFrame(name, fname, line)

    def _cstr(self, addr: int, *, deref: bool = False) -> str:
        b = self.mem.read(self.mem.u64(addr) if deref else addr, 16)
        return b.split(b"\0", 1)[0].decode("ascii", "replace")

    def _unicode(self, rt: _Runtime, addr: int) -> str:
        o = rt.off
        n = self.mem.u64(addr + o["unicode_length"])
        state = struct.unpack("<I", self.mem.read(addr + o["unicode_state"], 4))[0]
        kind, compact, ascii_ = state >> 2 & 7, state >> 5 & 1, state >> 6 & 1
        if not compact or kind not in (1, 2, 4) or n > MAX_STR:
            raise PyStackError(f"{addr:#x} is no compact str (read while the thread ran)")
        if ascii_:
            return self.mem.read(addr + o["unicode_ascii_size"], n).decode("ascii", "replace")
        # A compact non-ASCII str's data follows PyCompactUnicodeObject;
        # 3.13's debug offsets omit its size: 16 past the ASCII header.
        data = addr + o.get("unicode_compact_size", o["unicode_ascii_size"] + 16)
        raw = self.mem.read(data, n * kind)
        return raw.decode({1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}[kind], "replace")

    def _bytes(self, rt: _Runtime, addr: int) -> bytes:
        n = self.mem.u64(addr + rt.off["bytes_size"])
        if n > MAX_LINETABLE:
            raise PyStackError(f"{addr:#x} is no line table (read while the thread ran)")
        return self.mem.read(addr + rt.off["bytes_sval"], n) if n else b""


def _u64(b: bytes, off: int) -> int:
    return int(struct.unpack_from("<Q", b, off)[0])


def _varint(b: bytes, i: int) -> tuple[int, int]:
    v = b[i] & 63
    shift = 0
    while b[i] & 64:
        i += 1
        shift += 6
        v |= (b[i] & 63) << shift
    return v, i + 1


def line_of(table: bytes, firstlineno: int, unit: int) -> int | None:
    """The line of code unit `unit` by the 3.11+ location table
    (Objects/locations.md): entries of 1-8 units, each with a line delta."""
    line = firstlineno
    addr = 0
    i = 0
    try:
        while i < len(table):
            b = table[i]
            code, length = b >> 3 & 15, (b & 7) + 1
            i += 1
            has_line = True
            if code == 15:
                has_line = False
            elif code == 14:
                d, i = _varint(table, i)
                line += -(d >> 1) if d & 1 else d >> 1
                for _ in range(3):  # end line, column, end column
                    _, i = _varint(table, i)
            elif code == 13:
                d, i = _varint(table, i)
                line += -(d >> 1) if d & 1 else d >> 1
            elif code >= 10:
                line += code - 10
                i += 2
            else:
                i += 1
            if addr <= unit < addr + length:
                return line if has_line else None
            addr += length
    except IndexError:
        return None
    return None


def exe_id(pid: int) -> tuple[int, int]:
    """(st_dev, st_ino) of pid's executable: another one after an exec."""
    try:
        st = os.stat(f"/proc/{pid}/exe")
    except OSError:
        return (0, 0)
    return (st.st_dev, st.st_ino)


def _proc_maps(pid: int) -> list[tuple[int, int, str]]:
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for ln in f:
            parts = ln.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                lo = int(parts[0].split("-", 1)[0], 16)
                out.append((lo, int(parts[2], 16), parts[5].rstrip("\n")))
    return out


def read(pid: int, tid: int) -> PyStack | None:
    """One thread's Python stack, locating the interpreter afresh."""
    r = Reader(pid)
    try:
        return r.thread(tid)
    finally:
        r.close()
