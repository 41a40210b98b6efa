"""A small ctypes layer over libbpf (>= 1.0).

Which libbpf: GPUFAULT_LIBBPF if set, else the system's libbpf.so.1 where
the dynamic loader finds one, else the copy the wheel carries
(pyctl/data/lib, Debian's, with its libelf loaded first by absolute path so
libbpf's DT_NEEDED resolves to it). origin() says which; `gpufault doctor`
prints it.

Only what gpufault uses. libbpf 1.x returns NULL/negative and sets errno;
every wrapper turns that into BpfError with the operation in the message.
No compiler or kernel headers are needed: the objects are prebuilt CO-RE.
"""

from __future__ import annotations

import ctypes as C
import os
import struct
from collections.abc import Iterator
from typing import Any

from pyctl import paths
from pyctl.bpf import raw
from pyctl.elf import SHT_SYMTAB, ElfError, ElfFile
from pyctl.exceptions import MissingPrerequisite

# Threads that destroy links at once (see Object.detach_all).
DETACH_THREADS = 64
# uapi/linux/bpf.h: BPF_TRACE_UPROBE_MULTI (6.6+) and its return flag.
# libbpf 1.1 (Debian 12) has no uprobe_multi API: raw.bpf(BPF_LINK_CREATE).
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1
# 6.12+: one program at entry and at return, with a per-call cookie.
BPF_TRACE_UPROBE_SESSION = 57


class BpfError(OSError, MissingPrerequisite):
    """A libbpf or bpf() call failed; str() is a one-line message."""


class UprobeOpts(C.Structure):
    # struct bpf_uprobe_opts as of libbpf 1.1; `sz` lets newer libbpf
    # versions treat the fields it lacks as zero.
    _fields_ = [
        ("sz", C.c_size_t),
        ("ref_ctr_offset", C.c_size_t),
        ("bpf_cookie", C.c_uint64),
        ("retprobe", C.c_bool),
        ("func_name", C.c_char_p),
    ]


def _candidates() -> Iterator[tuple[str, str]]:
    """(kind, name) in the order tried: kind is 'GPUFAULT_LIBBPF', 'system'
    or 'bundled'. Lazily: the last, ctypes.util's search, imports
    subprocess and tempfile and runs ldconfig (~15 ms of every trace's
    start on the dev VM), so it runs only when the others failed."""
    env = os.environ.get("GPUFAULT_LIBBPF")
    if env:
        yield "GPUFAULT_LIBBPF", env
    yield "system", "libbpf.so.1"
    # The wheel's copy (GPU images usually have no libbpf).
    if paths.BUNDLED_LIBBPF.exists():
        yield "bundled", str(paths.BUNDLED_LIBBPF)
    # lazy: keeps ctypes (locale, selectors, +9 modules) off trace's start and `--help`
    import ctypes.util

    found = ctypes.util.find_library("bpf")
    if found and found != "libbpf.so.1":
        yield "system", found


def _loaded_path(lb: C.CDLL) -> str:
    """The file the dynamic loader mapped for lb (dlinfo RTLD_DI_LINKMAP)."""

    class LinkMap(C.Structure):
        _fields_ = [("l_addr", C.c_void_p), ("l_name", C.c_char_p)]

    try:
        dlinfo = C.CDLL(None).dlinfo  # glibc >= 2.34 has it in libc
    except AttributeError:
        dlinfo = C.CDLL("libdl.so.2").dlinfo
    lm = C.POINTER(LinkMap)()
    if dlinfo(C.c_void_p(lb._handle), 2, C.byref(lm)) == 0 and lm and lm.contents.l_name:
        return os.path.realpath(lm.contents.l_name.decode())
    return str(lb._name)


def _load() -> tuple[C.CDLL, str, str]:
    errors = []
    for kind, name in _candidates():
        try:
            if kind == "bundled" and paths.BUNDLED_LIBELF.exists():
                # libbpf's DT_NEEDED libelf.so.1 matches an object already
                # loaded under that soname: the bundled one, wherever it is.
                C.CDLL(str(paths.BUNDLED_LIBELF))
            lb = C.CDLL(name, use_errno=True)
        except OSError as e:
            errors.append(f"{name}: {e}")
            continue
        return lb, kind, _loaded_path(lb)
    raise BpfError(
        "libbpf (>= 1.0) not found: install Debian/Ubuntu package libbpf1, "
        "use the gpufault wheel (it carries one), or set GPUFAULT_LIBBPF=/path/to/libbpf.so.1"
        f" ({'; '.join(errors)})"
    )


_lib: C.CDLL | None = None
_origin: tuple[str, str] | None = None


def origin() -> tuple[str, str]:
    """(kind, path) of the libbpf in use, loading it if needed: kind is
    'system', 'bundled' (the wheel's pyctl/data/lib) or 'GPUFAULT_LIBBPF'."""
    lib()
    assert _origin is not None
    return _origin


def lib() -> C.CDLL:
    global _lib, _origin
    if _lib is None:
        lb, kind, path = _load()
        _declare(lb)
        _lib, _origin = lb, (kind, path)
        if not os.environ.get("GPUFAULT_DEBUG"):
            # Silence libbpf's stderr chatter; errors come back as errno.
            _lib.libbpf_set_print(None)
    return _lib


def _declare(lb: C.CDLL) -> None:
    vp, cp, i, u32 = C.c_void_p, C.c_char_p, C.c_int, C.c_uint32
    sig = {
        "libbpf_set_print": (vp, [vp]),
        "libbpf_major_version": (u32, []),
        "libbpf_minor_version": (u32, []),
        "bpf_object__open_file": (vp, [cp, vp]),
        "bpf_object__load": (i, [vp]),
        "bpf_object__close": (None, [vp]),
        "bpf_object__find_program_by_name": (vp, [vp, cp]),
        "bpf_object__next_map": (vp, [vp, vp]),
        "bpf_program__set_autoload": (i, [vp, C.c_bool]),
        "bpf_program__set_expected_attach_type": (i, [vp, i]),
        "bpf_program__fd": (i, [vp]),
        "bpf_program__attach": (vp, [vp]),
        "bpf_program__attach_uprobe_opts": (vp, [vp, i, cp, C.c_size_t, C.POINTER(UprobeOpts)]),
        "bpf_map__name": (cp, [vp]),
        "bpf_map__fd": (i, [vp]),
        "bpf_map__set_max_entries": (i, [vp, u32]),
        "bpf_map__max_entries": (u32, [vp]),
        "bpf_map__initial_value": (vp, [vp, C.POINTER(C.c_size_t)]),
        "bpf_link__destroy": (i, [vp]),
        "bpf_map_update_elem": (i, [i, vp, vp, C.c_uint64]),
        "bpf_map_lookup_elem": (i, [i, vp, vp]),
        "bpf_map_delete_elem": (i, [i, vp]),
        "bpf_map_get_next_key": (i, [i, vp, vp]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lb, name)
        fn.restype = res
        fn.argtypes = args


def version() -> tuple[int, int]:
    lb = lib()
    return int(lb.libbpf_major_version()), int(lb.libbpf_minor_version())


def _err(what: str) -> BpfError:
    e = C.get_errno()
    return BpfError(e, f"{what}: {os.strerror(e) if e else 'failed'}")


class Object:
    """One BPF object file: open, tune before load, load, attach, close."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = str(path)
        self._lib = lib()
        C.set_errno(0)
        self.ptr = self._lib.bpf_object__open_file(self.path.encode(), None)
        if not self.ptr:
            raise _err(f"cannot open BPF object {self.path}")
        self.links: list[int] = []
        self.link_fds: list[int] = []  # uprobe_multi links (raw fds)

    def program(self, name: str) -> int:
        p = self._lib.bpf_object__find_program_by_name(self.ptr, name.encode())
        if not p:
            raise BpfError(f"BPF program {name} not in {self.path}")
        return int(p)

    def map(self, name: str) -> int:
        """Find a map by name; '.rodata' finds the object's read-only data."""
        m = self._lib.bpf_object__next_map(self.ptr, None)
        while m:
            mname = self._lib.bpf_map__name(m).decode()
            if mname == name or (name.startswith(".") and mname.endswith(name)):
                return int(m)
            m = self._lib.bpf_object__next_map(self.ptr, m)
        raise BpfError(f"BPF map {name} not in {self.path}")

    def set_autoload(self, prog: str, on: bool) -> None:
        self._lib.bpf_program__set_autoload(self.program(prog), on)

    def set_max_entries(self, mapname: str, n: int) -> None:
        if self._lib.bpf_map__set_max_entries(self.map(mapname), n):
            raise _err(f"cannot size map {mapname}")

    def max_entries(self, mapname: str) -> int:
        return int(self._lib.bpf_map__max_entries(self.map(mapname)))

    def initial_value(self, mapname: str) -> tuple[int, int]:
        """Address and size of a global-data map's contents (before load)."""
        size = C.c_size_t(0)
        addr = self._lib.bpf_map__initial_value(self.map(mapname), C.byref(size))
        if not addr:
            raise BpfError(f"no initial value for {mapname}")
        return int(addr), size.value

    def set_rodata(self, values: dict[str, tuple[str, int]]) -> None:
        """Fill `const volatile` globals before load: name -> (struct format,
        value), at the offsets the object's own .symtab gives them."""
        addr, size = self.initial_value(".rodata")
        buf = (C.c_char * size).from_address(addr)
        syms = _symbol_values(self.path)
        if syms is None:
            raise BpfError(f"{self.path} has no .symtab: rebuild it with make build")
        for name, (fmt, v) in values.items():
            if name in syms:
                struct.pack_into(fmt, buf, syms[name], v)

    def load(self) -> None:
        C.set_errno(0)
        if self._lib.bpf_object__load(self.ptr):
            e = C.get_errno()
            raise BpfError(
                e, f"cannot load BPF object {os.path.basename(self.path)}: {os.strerror(e)}"
            )

    def map_fd(self, name: str) -> int:
        fd = self._lib.bpf_map__fd(self.map(name))
        if fd < 0:
            raise BpfError(f"map {name} has no fd (not loaded?)")
        return int(fd)

    def attach_uprobe(
        self, prog: str, pid: int, path: str, offset: int, cookie: int, retprobe: bool
    ) -> int:
        opts = UprobeOpts(
            sz=C.sizeof(UprobeOpts), bpf_cookie=cookie, retprobe=retprobe, func_name=None
        )
        C.set_errno(0)
        link = self._lib.bpf_program__attach_uprobe_opts(
            self.program(prog), pid, path.encode(), offset, C.byref(opts)
        )
        if not link:
            kind = "uretprobe" if retprobe else "uprobe"
            raise _err(f"cannot attach {kind} at {path}+{offset:#x}")
        self.links.append(int(link))
        return int(link)

    def attach(self, prog: str) -> int:
        C.set_errno(0)
        link = self._lib.bpf_program__attach(self.program(prog))
        if not link:
            raise _err(f"cannot attach {prog}")
        self.links.append(int(link))
        return int(link)

    def set_expected_attach_type(self, prog: str, attach_type: int) -> None:
        if self._lib.bpf_program__set_expected_attach_type(self.program(prog), attach_type):
            raise BpfError(f"cannot set the attach type of {prog}")

    def attach_uprobe_multi(
        self,
        prog: str,
        pid: int,
        path: str,
        offsets: list[int],
        cookies: list[int],
        retprobe: bool,
        attach_type: int = BPF_TRACE_UPROBE_MULTI,
    ) -> int:
        """One uprobe_multi link for many offsets of one file (the program
        must be loaded with the same attach_type: BPF_TRACE_UPROBE_MULTI, or
        BPF_TRACE_UPROBE_SESSION for a program that runs at entry and
        return). pid <= 0: every process. Returns the link fd; detach_all()
        closes it."""
        fd = self._lib.bpf_program__fd(self.program(prog))
        if fd < 0:
            raise BpfError(f"BPF program {prog} is not loaded")
        n = len(offsets)
        offs = (C.c_uint64 * n)(*offsets)
        cks = (C.c_uint64 * n)(*cookies)
        cpath = C.create_string_buffer(path.encode())
        attr = C.create_string_buffer(64)
        # link_create: prog_fd, target_fd, attach_type, flags, then the
        # uprobe_multi member: path, offsets, ref_ctr_offsets, cookies, cnt,
        # flags, pid.
        struct.pack_into(
            "=IIII QQQQ III",
            attr,
            0,
            fd,
            0,
            attach_type,
            0,
            C.addressof(cpath),
            C.addressof(offs),
            0,
            C.addressof(cks),
            n,
            BPF_F_UPROBE_MULTI_RETURN if retprobe else 0,
            max(pid, 0),
        )
        try:
            link = raw.bpf(raw.BPF_LINK_CREATE, attr)
        except OSError as e:
            kind = "uretprobe" if retprobe else "uprobe"
            where = f"{path}+{offsets[0]:#x}" if n == 1 else f"{n} sites in {path}"
            raise BpfError(e.errno, f"cannot attach {kind} at {where}: {e.strerror}") from None
        self.link_fds.append(link)
        return link

    def detach_all(self) -> None:
        """Destroy every link, many at once.

        Detaching a perf-event uprobe waits for RCU grace periods in the
        kernel, ~200 ms each on 6.18 (105 probes: 23 s one after another,
        19.7 s from 64 threads: mostly serialized in the kernel). That is why
        the engine uses one uprobe_multi link per file and direction where
        the kernel has them (one wait per link). Closing those few links from
        threads still halves the rest (4 links: 0.24 s in turn, 0.11 s at once).
        """
        links, self.links = self.links, []
        fds, self.link_fds = self.link_fds, []
        work = [(self._lib.bpf_link__destroy, ln) for ln in links] + [(os.close, fd) for fd in fds]
        if len(work) <= 1:
            for fn, x in work:
                fn(x)
            return
        # lazy: keeps concurrent (+11 modules) off trace's start and `--help`
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(DETACH_THREADS, len(work))) as pool:
            list(pool.map(lambda w: w[0](w[1]), work))

    def close(self) -> None:
        self.detach_all()
        if self.ptr:
            self._lib.bpf_object__close(self.ptr)
            self.ptr = None


def map_update(fd: int, key: C._CData, value: C._CData, flags: int = 0) -> None:
    C.set_errno(0)
    if lib().bpf_map_update_elem(fd, C.byref(key), C.byref(value), flags):
        raise _err("bpf map update")


def map_lookup(fd: int, key: C._CData, value: C._CData) -> bool:
    return lib().bpf_map_lookup_elem(fd, C.byref(key), C.byref(value)) == 0


def map_delete(fd: int, key: C._CData) -> bool:
    return lib().bpf_map_delete_elem(fd, C.byref(key)) == 0


def map_count(fd: int, key_size: int) -> int:
    """How many entries a hash map holds (walked key by key)."""
    cur = C.create_string_buffer(key_size)
    nxt = C.create_string_buffer(key_size)
    n = 0
    key: Any = None
    while lib().bpf_map_get_next_key(fd, key, nxt) == 0:
        n += 1
        C.memmove(cur, nxt, key_size)
        key = cur
        if n > 1 << 24:  # a map changing under us: never loop for ever
            break
    return n


def _symbol_values(path: str) -> dict[str, int] | None:
    """name -> st_value of a BPF object's .symtab (its globals: offsets in
    their section), from pyctl/elf.py (struct, no pyelftools: ~70 ms to
    import, then per-symbol parsing, was a visible part of every run's time
    to probes live). None: no .symtab."""
    try:
        with ElfFile.open(path) as f:
            sec = next((s for s in f.sections if s.type == SHT_SYMTAB), None)
            return None if sec is None else {s.name: s.value for s in f.symbols(sec)}
    except ElfError as e:
        raise BpfError(f"cannot read BPF object {path}: {e}: rebuild it with make build") from None
