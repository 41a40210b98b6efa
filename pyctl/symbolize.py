"""Turn user-stack addresses into 'lib!symbol+off' using /proc/PID/maps and
ELF symbols. Read at ingest time, while the process (usually) still lives."""

from __future__ import annotations

import bisect
import os
from pathlib import Path

from pyctl import resolve

_SORTED: dict[tuple[int, int, float], tuple[list[int], list[str]]] = {}


def _sorted_syms(path: str) -> tuple[list[int], list[str]]:
    key = resolve._file_key(path)
    if key in _SORTED:
        return _SORTED[key]
    table, _, _ = resolve._elf_symbols(path)
    items = sorted((addr, name) for name, (addr, _size) in table.items())
    _SORTED[key] = ([a for a, _ in items], [n for _, n in items])
    return _SORTED[key]


class Symbolizer:
    def __init__(self, pid: int):
        self.pid = pid
        self.maps: list[tuple[int, int, int, str]] = []
        # path -> load base, learnt from fires at known probe sites; used when
        # the process died before its maps could be read.
        self.known: dict[str, int] = {}
        self.refresh()

    def learn_base(self, path: str, base: int) -> None:
        self.known[path] = base

    def _from_known(self, addr: int) -> str | None:
        for path, base in self.known.items():
            rel = addr - base
            if rel < 0:
                continue
            try:
                addrs, names = _sorted_syms(path)
                table = resolve._elf_symbols(path)[0]
            except Exception:  # noqa: BLE001 - unreadable: no answer
                continue
            i = bisect.bisect_right(addrs, rel) - 1
            if i >= 0 and rel - addrs[i] < max(table[names[i]][1], 1):
                return f"{os.path.basename(path)}!{names[i]}+{rel - addrs[i]:#x}"
        return None

    def refresh(self) -> bool:
        """Re-read the maps; keep the last good copy once the process is gone
        (a target that crashes on its first fault is gone before we look)."""
        maps = []
        try:
            for line in Path(f"/proc/{self.pid}/maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) < 6 or not parts[5].startswith("/"):
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                maps.append((lo, hi, int(parts[2], 16), parts[5].strip()))
        except OSError:
            return False
        if maps:
            self.maps = maps
        return True

    def _load_bias(self, path: str) -> int | None:
        # The lowest mapping of a file at file offset 0 is its load base.
        bases = [lo - off for lo, _hi, off, p in self.maps if p == path]
        return min(bases) if bases else None

    def locate(self, addr: int) -> tuple[str, int] | None:
        """(library path as mapped, offset from its load base), or None."""
        if not any(lo <= addr < hi for lo, hi, _o, _p in self.maps):
            self.refresh()
        for lo, hi, _off, path in self.maps:
            if lo <= addr < hi:
                return path, addr - (self._load_bias(path) or 0)
        return None

    def symbolize(self, addr: int, *, parse: bool = True) -> str:
        """'lib!symbol+0xoff'. parse=False only uses symbol tables already
        read (the probed libraries): reading a big library's .symtab (torch's
        take tens of seconds) must not stall the ring consumer; such frames
        stay 'lib+0xoff' and `gpufault show` resolves them later."""
        loc = self.locate(addr)
        if loc is None:
            return self._from_known(addr) or f"{addr:#x}"
        path, rel = loc
        name = name_in(path, rel, self.pid, parse=parse)
        return name or f"{os.path.basename(path)}+{rel:#x}"


def name_in(path: str, rel: int, pid: int | None = None, *, parse: bool = True) -> str | None:
    """The symbol containing offset rel of library path, if known."""
    for real in ([f"/proc/{pid}/root{path}"] if pid else []) + [path]:
        if not os.path.exists(real):
            continue
        if not parse and not resolve.is_parsed(real):
            return None
        try:
            addrs, names = _sorted_syms(real)
        except Exception:  # noqa: BLE001 - unreadable ELF: no name
            return None
        i = bisect.bisect_right(addrs, rel) - 1
        if i >= 0:
            return f"{os.path.basename(path)}!{names[i]}+{rel - addrs[i]:#x}"
        return None
    return None
