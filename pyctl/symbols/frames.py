"""A fire's user stack as the frames the evidence stores: unwound by CFI
from the stack copy where there is one (pyctl/symbols/unwind.py), else
the kernel's frame-pointer walk (bpf_get_stack) with [sp] as the caller;
either way only addresses inside an executable mapping of the process,
each with its module, build-id, offset and how it was found, and why the
walk ended."""

from __future__ import annotations

from dataclasses import dataclass

from pyctl.symbols import unwind
from pyctl.symbols.mapwatch import MapWatch
from pyctl.symbols.symbolize import Symbolizer


@dataclass
class StoredFrame:
    depth: int
    address: int
    symbol: str
    module: str | None
    offset: int | None
    build_id: str | None
    method: str  # ip, cfi, fp, caller


def fire_frames(
    regs: dict[str, int],
    fp_addrs: list[int],
    caller: int,
    copy: tuple[int, bytes] | None,
    sym: Symbolizer,
    watch: MapWatch | None,
) -> tuple[list[StoredFrame], str]:
    """(frames, why the walk stopped). fp_addrs: bpf_get_stack's user
    stack (ip first); caller: [sp] at the entry; copy: (base, bytes)."""
    maps = watch.maps() if watch is not None else None
    if watch is not None:
        sym.offer(watch.file_maps())  # current: the process may be gone
    if maps is not None:
        sym.opener = maps.opened  # a container's files, checked against the mappings
    if copy is not None and maps is not None and copy[1]:
        walk = unwind.unwind(regs, unwind.Stack(*copy), maps)
        out = []
        for i, f in enumerate(walk.frames):
            name, loc = sym.frame(f.pc)
            out.append(StoredFrame(i, f.pc, name, loc[0] if loc else f.module,
                                   loc[1] if loc else f.offset, f.build_id or None,
                                   f.method))  # fmt: skip
        return out, walk.stop
    # The kernel's frame-pointer walk starts at the caller's frame and so
    # skips the caller itself: [sp] goes in as frame 1.
    addrs = list(fp_addrs)
    methods = ["ip"] + ["fp"] * max(0, len(addrs) - 1)
    if caller and addrs and (len(addrs) < 2 or addrs[1] != caller):
        addrs.insert(1, caller)
        methods.insert(1, "caller")
    out = []
    stop = "end of the frame-pointer chain"
    for addr, method in zip(addrs, methods, strict=True):
        if not addr:
            continue
        if maps is not None:
            m = maps.exec_at(addr)
            if m is None:
                stop = f"{addr:#x} is in no executable mapping (no stack copy to unwind)"
                break
        name, loc = sym.frame(addr)
        if maps is None and loc is None:
            stop = f"{addr:#x} is in no mapped file"
            break
        bid = None
        if loc is not None:
            fc = unwind.load(sym.opened(loc[0]))
            bid = fc.build_id if fc else None
        out.append(StoredFrame(len(out), addr, name, loc[0] if loc else None,
                               loc[1] if loc else None, bid, method))  # fmt: skip
    return out, stop
