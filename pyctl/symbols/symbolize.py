"""Turn user-stack addresses into 'lib!symbol+off' using /proc/PID/maps and
the function tables of pyctl/symbols/symtab.py (sizes, debug files: a frame outside
every known function is 'lib+0xoff', never the nearest wrong name). Read at
ingest time, while the process (usually) still lives."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from pyctl.symbols import resolve, symtab
from pyctl.targets.procfs import chroot_prefix, in_view, root_prefix


class Symbolizer:
    def __init__(self, pid: int):
        self.pid = pid
        # Its /proc/PID/root when not ours (a container, a chroot), kept
        # while it lives: what its mapped paths are opened through.
        self.root = root_prefix(pid)
        # path -> where to open it from here, when a MapWatch's Maps knows
        # better than root + path (a file mounted over the mapped one).
        self.opener: Callable[[str], str] | None = None
        self.maps: list[tuple[int, int, int, str]] = []
        # path -> load base, learnt from fires at known probe sites; used when
        # the process died before its maps could be read.
        self.known: dict[str, int] = {}
        self._display: dict[str, str] = {}  # known path -> path as the target sees it
        # addr -> (name, location): fires repeat the same call sites, and a
        # name costs a table lookup and a demangle. Cleared when the maps
        # change (a library unloaded and another loaded in its place).
        self._memo: dict[int, tuple[str, tuple[str, int] | None]] = {}
        self._memo_gen = symtab.generation
        self._offered: list[tuple[int, int, int, str]] | None = None
        self.refresh()
        self._pin_tables()

    def _pin_tables(self) -> None:
        """Read the function tables of this process's probed libraries now,
        while it lives: one that dies right after its fault (a SIGSEGV)
        takes /proc/PID/root with it, and its fire's stack is read after.
        symtab keeps what it read by path. Cheap tables (small, or in the
        disk cache) are read here; big uncached ones on a thread, so
        attaching does not wait seconds for libcuda's."""
        mine = f"/proc/{self.pid}/"
        paths = [p for p in resolve.PARSED_PATHS if p.startswith(mine) or
                 not p.startswith("/proc/")]  # fmt: skip
        slow = []
        for p in paths:
            if symtab.cheap(p):
                _try_load(p)
            else:
                slow.append(p)
        if slow:
            threading.Thread(target=_load_all, args=(slow,), daemon=True,
                             name="gf-symtab").start()  # fmt: skip

    def opened(self, path: str) -> str:
        """Where the process's file `path` is opened from here."""
        if self.opener is not None:
            return self.opener(path)
        return self.root + path if self.root and path.startswith("/") else path

    def learn_base(self, path: str, base: int, display: str | None = None) -> None:
        self.known[path] = base
        if display:
            self._display[path] = display

    def _from_known(self, addr: int) -> tuple[str, tuple[str, int]] | None:
        """(name, (library as the target sees it, offset)) from a base learnt
        at a probe site: for a frame outside the maps we hold (the process
        died before a library it loaded since could be seen in them)."""
        for path, base in self.known.items():
            rel = addr - base
            if rel >= 0 and (name := symtab.name_at(path, rel)):
                return name, (self._display.get(path, path), rel)
        return None

    def refresh(self) -> bool:
        """Re-read the maps; keep the last good copy once the process is gone
        (a target that crashes on its first fault is gone before we look)."""
        maps = read_maps(self.pid)
        if maps is None:
            return False
        self._adopt(maps)
        return True

    def offer(self, maps: list[tuple[int, int, int, str]]) -> None:
        """Maps read by another thread (the copilot's, while a faulted
        thread is held, so the process surely lives): taken up by this
        object's own thread at its next lookup."""
        self._offered = maps

    def _adopt(self, maps: list[tuple[int, int, int, str]]) -> None:
        if maps:
            if maps != self.maps:
                self._memo.clear()
            self.maps = maps

    def _load_bias(self, path: str) -> int | None:
        # The lowest mapping of a file at file offset 0 is its load base.
        bases = [lo - off for lo, _hi, off, p in self.maps if p == path]
        return min(bases) if bases else None

    def locate(self, addr: int) -> tuple[str, int] | None:
        """(library path as mapped, offset from its load base), or None."""
        offered, self._offered = self._offered, None
        if offered is not None:
            self._adopt(offered)
        if not any(lo <= addr < hi for lo, hi, _o, _p in self.maps):
            self.refresh()
        for lo, hi, _off, path in self.maps:
            if lo <= addr < hi:
                return path, addr - (self._load_bias(path) or 0)
        return None

    def frame(self, addr: int) -> tuple[str, tuple[str, int] | None]:
        """(symbolize(addr, parse=False), locate(addr)), memoized: what the
        ring consumer asks for each stack frame of each fire. A frame left
        as 'lib+0xoff' is asked again once another table has been read.
        """
        if self._memo_gen != symtab.generation:
            # A table was read since: unnamed frames may have names now.
            self._memo = {a: v for a, v in self._memo.items() if "!" in v[0]}
            self._memo_gen = symtab.generation
        hit = self._memo.get(addr)
        if hit is not None:
            return hit
        loc = self.locate(addr)
        name = self.symbolize(addr, parse=False)
        if loc is None and (known := self._from_known(addr)) is not None:
            name, loc = known
        self._memo[addr] = (name, loc)
        return name, loc

    def symbolize(self, addr: int, *, parse: bool = True) -> str:
        """'lib!symbol+0xoff'. parse=False only uses symbol tables already
        read (the probed libraries) or cheap to read (symtab.cheap: small,
        or in the disk cache): reading a big library's .symtab (torch's take
        seconds) must not stall the ring consumer; such frames stay
        'lib+0xoff' and `gpufault show` resolves them later."""
        loc = self.locate(addr)
        if loc is None:
            known = self._from_known(addr)
            return known[0] if known else f"{addr:#x}"
        path, rel = loc
        there = self.opened(path)
        if self.root and there != self.root + path:
            # Not the file at that path in its root: the mapped file itself.
            name = symtab.name_at(there, rel, "") if parse or symtab.cheap(there) else None
            if name is not None:  # 'RANGE!fn+0x0' -> 'lib!fn+0x0': the module's own name
                name = os.path.basename(path) + name[name.index("!") :]
        else:
            name = name_in(path, rel, self.pid, parse=parse)
        return name or f"{os.path.basename(path)}+{rel:#x}"


def read_maps(pid: int) -> list[tuple[int, int, int, str]] | None:
    """File-backed mappings of pid: (lo, hi, file offset, path); None if
    the process is gone."""
    # lazy: keeps pyctl.procstate (+1 module) off `--help`
    from pyctl.procstate import proc_dir

    maps = []
    try:
        # A live thread's maps when main has exited (pthread_exit).
        text = Path(f"{proc_dir(pid)}/maps").read_text()
    except OSError:
        return None
    pre = chroot_prefix(pid)  # a chroot's files as it names them
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        maps.append((lo, hi, int(parts[2], 16), in_view(parts[5].strip(), pre)))
    return maps


def name_in(path: str, rel: int, pid: int | None = None, *, parse: bool = True) -> str | None:
    """The function containing offset rel of library path, if known.
    parse=False: only files whose tables were read already (the probed
    libraries: resolve parsed them to attach); reading a big library's
    tables must not stall the ring consumer."""
    for root in ([f"/proc/{pid}/root"] if pid else []) + [""]:
        real = root + path
        # Read while the process lived: named even though it is gone.
        pinned = symtab.is_loaded(real)
        if not pinned and not os.path.exists(real):
            continue
        if not parse and not (pinned or resolve.is_parsed(real) or symtab.cheap(real)):
            return None
        return symtab.name_at(path, rel, root)
    return None


def _load_all(paths: list[str]) -> None:
    for p in paths:
        _try_load(p)


def _try_load(path: str) -> None:
    try:
        symtab.load(path)
    except Exception:  # noqa: BLE001 - unreadable or not ELF: frames stay lib+0xoff
        pass
