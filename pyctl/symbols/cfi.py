"""Call-frame information of one ELF file: `.eh_frame` (found through
`.eh_frame_hdr`'s binary-search table) and `.debug_frame`, decoded to the
CFA rule and the saved-register rules at one address.

Why not pyelftools' CFI: `DWARFInfo.EH_CFI_entries()` parses every entry
of a section before it answers one lookup: 2.1 s for Debian's libc (3,717
entries), 3.6 s for libstdc++ on this machine, at the fire of a target
that just died. Here a lookup is a bisect in `.eh_frame_hdr`'s table
(read with struct at once) and the decoding of one FDE and its CIE
(memoized), so a run pays for the frames it meets, not for the file.

Registers are DWARF x86-64 numbers (0 rax, 1 rdx, 2 rcx, 3 rbx, 4 rsi,
5 rdi, 6 rbp, 7 rsp, 8-15 r8-r15, 16 the return address).
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass, field

RSP, RBP, RA = 7, 6, 16

# DW_EH_PE_*: pointer encodings of .eh_frame and .eh_frame_hdr.
PE_OMIT = 0xFF
PE_ABSPTR, PE_ULEB, PE_UDATA2, PE_UDATA4, PE_UDATA8 = 0x00, 0x01, 0x02, 0x03, 0x04
PE_SLEB, PE_SDATA2, PE_SDATA4, PE_SDATA8 = 0x09, 0x0A, 0x0B, 0x0C
PE_PCREL, PE_TEXTREL, PE_DATAREL, PE_FUNCREL, PE_ALIGNED = 0x10, 0x20, 0x30, 0x40, 0x50
PE_INDIRECT = 0x80


class CfiError(ValueError):
    """CFI this decoder cannot read (truncated, an unknown instruction)."""


def uleb(b: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if i >= len(b):
            raise CfiError("truncated LEB128")
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return v, i


def sleb(b: bytes, i: int) -> tuple[int, int]:
    """uleb's bits, sign-extended from the last byte's bit 6."""
    v, j = uleb(b, i)
    if b[j - 1] & 0x40:
        v -= 1 << (7 * (j - i))
    return v, j


_FIXED = {
    PE_UDATA2: "<H", PE_UDATA4: "<I", PE_UDATA8: "<Q", PE_ABSPTR: "<Q",
    PE_SDATA2: "<h", PE_SDATA4: "<i", PE_SDATA8: "<q",
}  # fmt: skip


def read_encoded(b: bytes, i: int, enc: int, here: int, data_base: int = 0) -> tuple[int, int]:
    """A DW_EH_PE-encoded pointer at b[i]; here: the vaddr of b[i] (pcrel),
    data_base: .eh_frame_hdr's vaddr (datarel)."""
    if enc == PE_OMIT:
        return 0, i
    fmt = enc & 0x0F
    if fmt == PE_ULEB:
        v, j = uleb(b, i)
    elif fmt == PE_SLEB:
        v, j = sleb(b, i)
    elif fmt in _FIXED:
        f = _FIXED[fmt]
        n = struct.calcsize(f)
        if i + n > len(b):
            raise CfiError("truncated pointer")
        (v,) = struct.unpack_from(f, b, i)
        j = i + n
    else:
        raise CfiError(f"pointer encoding {enc:#x}")
    app = enc & 0x70
    if app == PE_PCREL:
        v += here
    elif app == PE_DATAREL:
        v += data_base
    elif app not in (0, PE_TEXTREL, PE_FUNCREL):
        raise CfiError(f"pointer application {enc:#x}")
    if enc & PE_INDIRECT:
        raise CfiError("indirect pointer in CFI")
    return v & 0xFFFFFFFFFFFFFFFF, j


@dataclass
class Cie:
    code_align: int
    data_align: int
    ra_reg: int
    fde_enc: int = PE_ABSPTR
    has_aug_data: bool = False
    signal_frame: bool = False
    insns: bytes = b""


@dataclass
class Fde:
    cie: Cie
    pc_lo: int
    pc_hi: int
    insns: bytes


# A register's rule: ("same",), ("undef",), ("off", n): saved at CFA+n,
# ("valoff", n): its value is CFA+n, ("reg", r): in register r,
# ("expr", bytes): saved at the address the expression gives,
# ("valexpr", bytes).
Rule = tuple


@dataclass
class Row:
    """What unwinds one frame at one address: CFA = reg + offset (or an
    expression), and where each saved register is."""

    cfa_reg: int = RSP
    cfa_off: int = 8
    cfa_expr: bytes | None = None
    regs: dict[int, Rule] = field(default_factory=dict)
    signal_frame: bool = False

    def copy(self) -> Row:
        return Row(self.cfa_reg, self.cfa_off, self.cfa_expr, dict(self.regs), self.signal_frame)


class Section:
    """One CFI section's bytes and the vaddr they load at."""

    def __init__(self, data: bytes, addr: int, eh: bool) -> None:
        self.data = data
        self.addr = addr
        self.eh = eh  # .eh_frame (pc-relative, CIE pointer relative) or .debug_frame
        self._cies: dict[int, Cie] = {}
        self._fdes: dict[int, Fde | None] = {}

    def _cie(self, off: int) -> Cie:
        hit = self._cies.get(off)
        if hit is not None:
            return hit
        b = self.data
        length, i = self._length(off)
        end = i + length
        i += 8 if length == 0 or self._is64(off) else 4  # CIE id
        version = b[i]
        i += 1
        z = b.index(b"\0", i)
        aug = b[i:z].decode("ascii", "replace")
        i = z + 1
        if version >= 4:
            i += 2  # address_size, segment_selector_size
        code_align, i = uleb(b, i)
        data_align, i = sleb(b, i)
        if version == 1:
            ra_reg, i = b[i], i + 1
        else:
            ra_reg, i = uleb(b, i)
        cie = Cie(code_align, data_align, ra_reg)
        if aug.startswith("z"):
            n, i = uleb(b, i)
            j, stop = i, i + n
            for ch in aug[1:]:
                if ch == "R":
                    cie.fde_enc, j = b[j], j + 1
                elif ch == "P":
                    penc = b[j]
                    _, j = read_encoded(b, j + 1, penc & 0x7F, self.addr + j + 1)
                elif ch == "L":
                    j += 1
                elif ch == "S":
                    cie.signal_frame = True
                elif ch in "BG":
                    pass
                else:
                    break  # unknown: the length lets us skip the rest
            cie.has_aug_data = True
            i = stop
        elif aug not in ("",):
            if "eh" in aug:
                i += 8
            else:
                raise CfiError(f"CIE augmentation {aug!r}")
        cie.insns = b[i:end]
        self._cies[off] = cie
        return cie

    def _is64(self, off: int) -> bool:
        return struct.unpack_from("<I", self.data, off)[0] == 0xFFFFFFFF

    def _length(self, off: int) -> tuple[int, int]:
        (n,) = struct.unpack_from("<I", self.data, off)
        if n == 0xFFFFFFFF:
            (n,) = struct.unpack_from("<Q", self.data, off + 4)
            return n, off + 12
        return n, off + 4

    def entry(self, off: int) -> Fde | None:
        """The FDE at section offset off (None: a CIE or a terminator)."""
        if off in self._fdes:
            return self._fdes[off]
        fde = self._parse_fde(off)
        self._fdes[off] = fde
        return fde

    def _parse_fde(self, off: int) -> Fde | None:
        b = self.data
        if off + 4 > len(b):
            raise CfiError("entry past the section")
        length, i = self._length(off)
        if length == 0:
            return None
        end = i + length
        wide = self._is64(off)
        idfmt = "<Q" if wide else "<I"
        (cid,) = struct.unpack_from(idfmt, b, i)
        if self.eh:
            if cid == 0:
                return None  # a CIE
            cie_off = i - cid
        else:
            if cid == (0xFFFFFFFFFFFFFFFF if wide else 0xFFFFFFFF):
                return None
            cie_off = cid
        i += 8 if wide else 4
        cie = self._cie(cie_off)
        if self.eh:
            pc_lo, i = read_encoded(b, i, cie.fde_enc, self.addr + i)
            rng, i = read_encoded(b, i, cie.fde_enc & 0x0F, 0)
        else:
            pc_lo, rng = struct.unpack_from("<QQ", b, i)
            i += 16
        if cie.has_aug_data:
            n, i = uleb(b, i)
            i += n
        return Fde(cie, pc_lo, pc_lo + rng, b[i:end])

    def scan(self) -> list[tuple[int, int]]:
        """(pc_lo, offset) of every FDE: for a section without a search table."""
        out = []
        off = 0
        while off + 4 <= len(self.data):
            length, i = self._length(off)
            if length == 0:
                if self.eh:
                    break
                off = i
                continue
            try:
                fde = self.entry(off)
            except (CfiError, struct.error, IndexError, ValueError):
                fde = None
            if fde is not None and fde.pc_hi > fde.pc_lo:
                out.append((fde.pc_lo, off))
            off = i + length
        out.sort()
        return out


def eh_frame_hdr_table(hdr: bytes, hdr_addr: int, eh_addr: int) -> list[tuple[int, int]] | None:
    """.eh_frame_hdr's sorted (initial pc, .eh_frame offset) table, or None
    when it has none (then the section is scanned)."""
    if len(hdr) < 4 or hdr[0] != 1:
        return None
    ptr_enc, cnt_enc, tab_enc = hdr[1], hdr[2], hdr[3]
    i = 4
    _, i = read_encoded(hdr, i, ptr_enc, hdr_addr + i, hdr_addr)
    if cnt_enc == PE_OMIT or tab_enc == PE_OMIT:
        return None
    count, i = read_encoded(hdr, i, cnt_enc, hdr_addr + i, hdr_addr)
    if tab_enc == PE_DATAREL | PE_SDATA4:  # what every linker writes: one unpack
        n = min(count, (len(hdr) - i) // 8)
        vals = struct.unpack_from(f"<{2 * n}i", hdr, i)
        base = hdr_addr - eh_addr
        return [(vals[k] + hdr_addr, vals[k + 1] + base) for k in range(0, 2 * n, 2)]
    out = []
    for _ in range(count):
        pc, i = read_encoded(hdr, i, tab_enc, hdr_addr + i, hdr_addr)
        fa, i = read_encoded(hdr, i, tab_enc, hdr_addr + i, hdr_addr)
        out.append((pc, fa - eh_addr))
    return out


def execute(fde: Fde, target: int) -> Row:
    """The CFA row in effect at vaddr target: the CIE's initial
    instructions, then the FDE's up to target."""
    cie = fde.cie
    row = Row(signal_frame=cie.signal_frame)
    _run(cie.insns, cie, row, None, fde.pc_lo, target, None)
    initial = row.copy()
    _run(fde.insns, cie, row, initial, fde.pc_lo, target, None)
    return row


def _run(code: bytes, cie: Cie, row: Row, initial: Row | None, loc: int, target: int,
         _unused: None) -> None:  # fmt: skip
    stack: list[Row] = []
    i = 0
    n = len(code)
    ca, da = cie.code_align, cie.data_align
    while i < n:
        op = code[i]
        i += 1
        hi, lo = op & 0xC0, op & 0x3F
        if hi == 0x40:  # advance_loc
            loc += lo * ca
            if loc > target:
                return
            continue
        if hi == 0x80:  # offset
            v, i = uleb(code, i)
            row.regs[lo] = ("off", v * da)
            continue
        if hi == 0xC0:  # restore
            _restore(row, initial, lo)
            continue
        if op == 0x00:
            continue
        if op == 0x01:  # set_loc
            loc, i = read_encoded(code, i, cie.fde_enc, 0)
            if loc > target:
                return
        elif op in (0x02, 0x03, 0x04):  # advance_loc1/2/4
            f = {0x02: "<B", 0x03: "<H", 0x04: "<I"}[op]
            (d,) = struct.unpack_from(f, code, i)
            i += struct.calcsize(f)
            loc += d * ca
            if loc > target:
                return
        elif op == 0x05:  # offset_extended
            r, i = uleb(code, i)
            v, i = uleb(code, i)
            row.regs[r] = ("off", v * da)
        elif op == 0x06:  # restore_extended
            r, i = uleb(code, i)
            _restore(row, initial, r)
        elif op == 0x07:  # undefined
            r, i = uleb(code, i)
            row.regs[r] = ("undef",)
        elif op == 0x08:  # same_value
            r, i = uleb(code, i)
            row.regs[r] = ("same",)
        elif op == 0x09:  # register
            r, i = uleb(code, i)
            r2, i = uleb(code, i)
            row.regs[r] = ("reg", r2)
        elif op == 0x0A:  # remember_state
            stack.append(row.copy())
        elif op == 0x0B:  # restore_state
            if stack:
                s = stack.pop()
                row.cfa_reg, row.cfa_off, row.cfa_expr, row.regs = (
                    s.cfa_reg, s.cfa_off, s.cfa_expr, s.regs)  # fmt: skip
        elif op == 0x0C:  # def_cfa
            row.cfa_reg, i = uleb(code, i)
            row.cfa_off, i = uleb(code, i)
            row.cfa_expr = None
        elif op == 0x0D:  # def_cfa_register
            row.cfa_reg, i = uleb(code, i)
            row.cfa_expr = None
        elif op == 0x0E:  # def_cfa_offset
            row.cfa_off, i = uleb(code, i)
        elif op == 0x0F:  # def_cfa_expression
            ln, i = uleb(code, i)
            row.cfa_expr = code[i : i + ln]
            i += ln
        elif op in (0x10, 0x16):  # expression, val_expression
            r, i = uleb(code, i)
            ln, i = uleb(code, i)
            row.regs[r] = ("expr" if op == 0x10 else "valexpr", code[i : i + ln])
            i += ln
        elif op == 0x11:  # offset_extended_sf
            r, i = uleb(code, i)
            v, i = sleb(code, i)
            row.regs[r] = ("off", v * da)
        elif op == 0x12:  # def_cfa_sf
            row.cfa_reg, i = uleb(code, i)
            v, i = sleb(code, i)
            row.cfa_off, row.cfa_expr = v * da, None
        elif op == 0x13:  # def_cfa_offset_sf
            v, i = sleb(code, i)
            row.cfa_off = v * da
        elif op in (0x14, 0x15):  # val_offset, val_offset_sf
            r, i = uleb(code, i)
            v, i = uleb(code, i) if op == 0x14 else sleb(code, i)
            row.regs[r] = ("valoff", v * da)
        elif op == 0x2E:  # GNU_args_size
            _, i = uleb(code, i)
        elif op == 0x2F:  # GNU_negative_offset_extended
            r, i = uleb(code, i)
            v, i = uleb(code, i)
            row.regs[r] = ("off", -v * da)
        else:
            raise CfiError(f"CFA instruction {op:#x}")


def _restore(row: Row, initial: Row | None, reg: int) -> None:
    if initial is not None and reg in initial.regs:
        row.regs[reg] = initial.regs[reg]
    else:
        row.regs.pop(reg, None)


class Table:
    """The CFI of one file: rows by vaddr, the FDEs found by bisect."""

    def __init__(self, sections: list[tuple[Section, list[tuple[int, int]]]]) -> None:
        self.sections = sections
        self._keys = [[pc for pc, _ in idx] for _, idx in sections]
        self._rows: dict[int, Row | None] = {}

    def __len__(self) -> int:
        return sum(len(idx) for _, idx in self.sections)

    def row(self, vaddr: int) -> Row | None:
        """The rule at vaddr, or None where no FDE covers it."""
        if vaddr in self._rows:
            return self._rows[vaddr]
        found = None
        for (sec, idx), keys in zip(self.sections, self._keys, strict=True):
            k = bisect.bisect_right(keys, vaddr) - 1
            if k < 0:
                continue
            fde = sec.entry(idx[k][1])
            if fde is not None and fde.pc_lo <= vaddr < fde.pc_hi:
                found = execute(fde, vaddr)
                break
        if len(self._rows) > 65536:
            self._rows.clear()
        self._rows[vaddr] = found
        return found


def table_from(frames: dict[str, tuple[int, bytes]]) -> Table:
    """A Table from a file's frame sections: name -> (sh_addr, bytes)."""
    secs: list[tuple[Section, list[tuple[int, int]]]] = []
    if ".eh_frame" in frames:
        addr, data = frames[".eh_frame"]
        sec = Section(data, addr, eh=True)
        idx = None
        if ".eh_frame_hdr" in frames:
            haddr, hdr = frames[".eh_frame_hdr"]
            try:
                idx = eh_frame_hdr_table(hdr, haddr, addr)
            except (CfiError, struct.error):
                idx = None
        secs.append((sec, idx if idx is not None else sec.scan()))
    if ".debug_frame" in frames:
        addr, data = frames[".debug_frame"]
        sec = Section(data, 0, eh=False)
        secs.append((sec, sec.scan()))
    return Table(secs)
