"""Unwind a fired thread's user stack from its registers and a copy of the
top of its stack (bpf/gpufault.h struct gf_ustack_event), with the
binaries' call-frame information (pyctl/symbols/cfi.py), the way
`perf record --call-graph dwarf` does after the fact.

Frame pointers are garbage in -O2 code built without them: the kernel's
frame-pointer walk read `0x0000207065747320` (ASCII from the stack) as a
return address. Here each frame says how it was found:
- `ip`: the probed instruction (regs.ip);
- `cfi`: the return address where the FDE covering the pc says it is;
- `fp`: no FDE covers the pc (JIT code, a file without .eh_frame) and rbp
  looks like a frame pointer: [rbp+8], the frame-pointer fast path.
A frame is kept only if its address lies in an executable mapping of the
process, and the walk stops, saying why (Walk.stop), at the end of the
copy, an address outside every executable mapping, an undefined return
address (the outermost frame: clone3's and _start's CFI say so), or a
pc no rule covers.

Tables are kept per build-id (a file at another path, or the same path
after the process is gone, is the same build). The bytes come from
pyctl/elf.py, the one ELF reader; the CFI decoding is cfi.py's (see there
why not pyelftools').
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from pyctl import elf
from pyctl.symbols import cfi
from pyctl.symbols.maps import Loads, Maps
from pyctl.symbols.symtab import debug_files

MAX_FRAMES = 128

# pt_regs names (pyctl/bpf/abi.py REG_NAMES) -> DWARF x86-64 numbers.
DWARF_OF = {
    "ax": 0, "dx": 1, "cx": 2, "bx": 3, "si": 4, "di": 5, "bp": 6, "sp": 7,
    "r8": 8, "r9": 9, "r10": 10, "r11": 11, "r12": 12, "r13": 13, "r14": 14, "r15": 15,
    "ip": 16,
}  # fmt: skip
# What a called function must preserve (SysV): all a caller's CFI refers to.
CALLEE_SAVED = (3, 6, 12, 13, 14, 15)


@dataclass
class Frame:
    pc: int
    method: str  # ip, cfi, fp
    module: str = ""  # path as the target sees it
    build_id: str = ""
    offset: int = 0  # pc - the module's load base (the stacks table's offset)


@dataclass
class Walk:
    frames: list[Frame] = field(default_factory=list)
    stop: str = ""  # why the walk ended


@dataclass
class FileCfi:
    """One file's unwind data: its CFI and its PT_LOAD segments."""

    build_id: str
    loads: list[tuple[int, int, int, int]]  # (p_offset, p_vaddr, p_filesz, p_flags)
    table: cfi.Table

    def vaddr_of(self, file_off: int) -> int | None:
        for off, vaddr, size, _flags in self.loads:
            if off <= file_off < off + size:
                return file_off - off + vaddr
        return None


_BY_BUILD_ID: dict[str, FileCfi] = {}
_BY_KEY: dict[tuple[int, int, float], FileCfi] = {}
_BY_PATH: dict[str, FileCfi] = {}  # the last read through a path: it may be gone
# Unwinding data is read once per file per controller; tests count reads.
reads = 0


def _read_elf(path: str) -> tuple[str, Loads, dict[str, tuple[int, bytes]]]:
    """(build-id, PT_LOADs, frame sections name -> (sh_addr, bytes)). A
    file with no .debug_frame of its own takes the one of its MiniDebugInfo
    or of its debug file (by build-id or debuglink): code built without
    unwind tables, stripped, keeps its CFI there."""
    with elf.ElfFile.open(path) as f:
        loads = [(s.offset, s.vaddr, s.filesz, s.flags) for s in f.loads]
        frames = {n: (sec.addr, data) for n, (sec, data) in f.frame_sections().items()}
        if ".debug_frame" not in frames:
            elsewhere = _debug_frame_elsewhere(path, f)
            if elsewhere is not None:
                frames[".debug_frame"] = elsewhere
        return f.build_id, loads, frames


def _debug_frame_elsewhere(path: str, f: elf.ElfFile) -> tuple[int, bytes] | None:
    """.debug_frame from f's .gnu_debugdata, else from its debug file of
    the same build (the places symtab.py looks for names)."""
    mini = f.minidebuginfo()
    if mini is not None:
        with mini:
            got = _own_debug_frame(mini)
        if got is not None:
            return got
    for _cand, dbg in debug_files(path, f.build_id, f.debuglink, path):
        if (got := _own_debug_frame(dbg)) is not None:
            return got
    return None


def _own_debug_frame(f: elf.ElfFile) -> tuple[int, bytes] | None:
    try:
        got = f.frame_sections().get(".debug_frame")
    except elf.ElfError:
        return None
    return None if got is None else (got[0].addr, got[1])


def load(path: str) -> FileCfi | None:
    """The unwind data of path (cached by build-id, inode and path);
    None when it cannot be read."""
    global reads
    try:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_mtime)
    except OSError:
        return _BY_PATH.get(path)
    hit = _BY_KEY.get(key)
    if hit is not None:
        return hit
    try:
        bid, loads, frames = _read_elf(path)
    except Exception:  # noqa: BLE001 - not ELF, unreadable: no CFI for it
        return None
    got = _BY_BUILD_ID.get(bid) if bid else None
    if got is None:
        reads += 1
        got = FileCfi(bid, loads, cfi.table_from(frames))
        if bid:
            _BY_BUILD_ID[bid] = got
    _BY_KEY[key] = _BY_PATH[path] = got
    return got


class Stack:
    """The copied stack: bytes from base up."""

    def __init__(self, base: int, data: bytes) -> None:
        self.base = base
        self.data = data
        self.top = base + len(data)

    def u64(self, addr: int) -> int | None:
        i = addr - self.base
        if i < 0 or i + 8 > len(self.data):
            return None
        return struct.unpack_from("<Q", self.data, i)[0]


def _expr(code: bytes, regs: dict[int, int], stack: Stack, push_cfa: int | None) -> int | None:
    """A DWARF expression of the kind CFI uses (the PLT's CFA rule:
    rsp + 8 + ((rip & 15) >= 11) << 3); None for what it cannot evaluate."""
    st: list[int] = [] if push_cfa is None else [push_cfa]
    i = 0
    m = 0xFFFFFFFFFFFFFFFF
    try:
        while i < len(code):
            op = code[i]
            i += 1
            if 0x30 <= op <= 0x4F:  # lit0..31
                st.append(op - 0x30)
            elif 0x70 <= op <= 0x8F:  # breg0..31
                off, i = cfi.sleb(code, i)
                r = regs.get(op - 0x70)
                if r is None:
                    return None
                st.append((r + off) & m)
            elif op == 0x08:  # const1u
                st.append(code[i])
                i += 1
            elif op == 0x09:  # const1s
                st.append(struct.unpack_from("<b", code, i)[0] & m)
                i += 1
            elif op in (0x0A, 0x0B):
                st.append(struct.unpack_from("<H" if op == 0x0A else "<h", code, i)[0] & m)
                i += 2
            elif op in (0x0C, 0x0D):
                st.append(struct.unpack_from("<I" if op == 0x0C else "<i", code, i)[0] & m)
                i += 4
            elif op == 0x10:  # constu
                v, i = cfi.uleb(code, i)
                st.append(v)
            elif op == 0x11:  # consts
                v, i = cfi.sleb(code, i)
                st.append(v & m)
            elif op == 0x12:  # dup
                st.append(st[-1])
            elif op == 0x06:  # deref
                word = stack.u64(st.pop())
                if word is None:
                    return None
                st.append(word)
            elif op == 0x23:  # plus_uconst
                v, i = cfi.uleb(code, i)
                st.append((st.pop() + v) & m)
            elif op in (0x1A, 0x1C, 0x1E, 0x21, 0x22, 0x24, 0x25, 0x27, 0x29, 0x2A, 0x2B,
                        0x2C, 0x2D, 0x2E):  # fmt: skip
                b, a = st.pop(), st.pop()
                st.append({
                    0x1A: a & b, 0x1C: (a - b) & m, 0x1E: (a * b) & m, 0x21: a | b,
                    0x22: (a + b) & m, 0x24: (a << b) & m, 0x25: a >> b, 0x27: a ^ b,
                    0x29: int(a == b), 0x2A: int(a >= b), 0x2B: int(a > b),
                    0x2C: int(a <= b), 0x2D: int(a < b), 0x2E: int(a != b),
                }[op])  # fmt: skip
            else:
                return None
    except (IndexError, struct.error, cfi.CfiError):
        return None
    return st[-1] if st else None


Loader = Callable[[str], "FileCfi | None"]


def unwind(
    regs: dict[str, int],
    stack: Stack,
    maps: Maps,
    *,
    loader: Loader | None = None,
    max_frames: int = MAX_FRAMES,
) -> Walk:
    """Frames from the registers at a fire (pt_regs names) and the copy."""
    if loader is None:
        # One stat per module per Maps, not per frame: a Maps is one fire's
        # (or one process's between changes).
        memo = maps.cfi_memo

        def loader(path: str) -> FileCfi | None:
            if path not in memo:
                # A container's file through its root: the host may have
                # no file at that path, or another one.
                memo[path] = load(maps.opened(path))
            return memo[path]

    cur = {DWARF_OF[k]: v for k, v in regs.items() if k in DWARF_OF}
    walk = Walk()
    method = "ip"
    first = True
    while True:
        pc = cur[cfi.RA]
        m = maps.exec_at(pc)
        if m is None:
            walk.stop = (f"{pc:#x} is in no executable mapping" if not first else
                         f"ip {pc:#x} is in no executable mapping")  # fmt: skip
            return walk
        fc = loader(m.path)
        walk.frames.append(Frame(pc, method, m.path, fc.build_id if fc else "",
                                 pc - maps.load_base(m.path)))  # fmt: skip
        if len(walk.frames) >= max_frames:
            walk.stop = f"{max_frames} frames"
            return walk
        # A return address is after its call: look up the call (pc - 1),
        # except at the probed instruction and in a signal frame.
        row = None
        if fc is not None:
            vaddr = fc.vaddr_of(pc - m.lo + m.offset)
            if vaddr is not None:
                row = fc.table.row(vaddr if first else vaddr - 1)
                if row is not None and row.signal_frame and not first:
                    row = fc.table.row(vaddr)
        nxt = _step_cfi(row, cur, stack) if row is not None else None
        if row is not None and nxt is None:
            walk.stop = f"the rule at {pc:#x} points outside the copied stack"
            return walk
        if isinstance(nxt, str):
            walk.stop = nxt
            return walk
        method = "cfi"
        if nxt is None:
            nxt = _step_fp(cur, stack)
            method = "fp"
            if nxt is None:
                walk.stop = f"no CFI covers {pc:#x} and rbp is no frame pointer"
                return walk
        if nxt[cfi.RSP] <= cur[cfi.RSP] and not first:
            walk.stop = "the stack pointer did not move"
            return walk
        if nxt[cfi.RA] == 0:
            walk.stop = "return address 0: the outermost frame"
            return walk
        cur = nxt
        first = False


def _step_cfi(row: cfi.Row, cur: dict[int, int], stack: Stack) -> dict[int, int] | str | None:
    """The caller's registers by the CFA row; a str says why the walk ends
    here cleanly; None: a value the copy does not hold."""
    if row.cfa_expr is not None:
        cfa = _expr(row.cfa_expr, cur, stack, None)
        if cfa is None:
            return None
    else:
        base = cur.get(row.cfa_reg)
        if base is None:
            return f"the CFA is based on r{row.cfa_reg}, unknown here"
        cfa = (base + row.cfa_off) & 0xFFFFFFFFFFFFFFFF
    ra_rule = row.regs.get(cfi.RA, ("off", -8))
    if ra_rule[0] == "undef":
        return "return address undefined: the outermost frame"
    nxt = {r: v for r, v in cur.items() if r in CALLEE_SAVED}
    for reg, rule in list(row.regs.items()) + [(cfi.RA, ra_rule)]:
        kind = rule[0]
        if kind == "off":
            v = stack.u64(cfa + rule[1])
            if v is None:
                if reg == cfi.RA:
                    return None
                nxt.pop(reg, None)
                continue
            nxt[reg] = v
        elif kind == "valoff":
            nxt[reg] = cfa + rule[1]
        elif kind == "reg":
            if rule[1] in cur:
                nxt[reg] = cur[rule[1]]
        elif kind in ("expr", "valexpr"):
            v = _expr(rule[1], cur, stack, cfa)
            if v is not None and kind == "expr":
                v = stack.u64(v)
            if v is None:
                if reg == cfi.RA:
                    return None
                nxt.pop(reg, None)
                continue
            nxt[reg] = v
        elif kind == "undef":
            nxt.pop(reg, None)
        elif kind == "same" and reg in cur:
            nxt[reg] = cur[reg]
    nxt[cfi.RSP] = cfa
    return nxt


def _step_fp(cur: dict[int, int], stack: Stack) -> dict[int, int] | None:
    """The frame-pointer step, where rbp points into the copy above sp."""
    bp = cur.get(cfi.RBP)
    if bp is None or bp & 7 or not cur[cfi.RSP] <= bp < stack.top - 16:
        return None
    ra, saved = stack.u64(bp + 8), stack.u64(bp)
    if ra is None or saved is None:
        return None
    nxt = {r: v for r, v in cur.items() if r in CALLEE_SAVED}
    nxt.update({cfi.RBP: saved, cfi.RSP: bp + 16, cfi.RA: ra})
    return nxt
