"""The one ELF reader: header, sections, segments, notes (build-id),
symbol tables, the dynamic section, MiniDebugInfo and compressed sections,
read with struct from a file descriptor.

Every module that needs something from an ELF file asks this one
(tests/test_elf.py fails on any other that unpacks ELF structures, looks
for the magic or imports pyelftools). It sits with the base utilities
because the lowest layers need it: pyctl/bpf/libbpf.py reads a BPF
object's `.symtab`, pyctl/symbols/ everything else.

Why struct and not pyelftools (numbers in docs/symbols.md, "The ELF
reader"): importing pyelftools alone costs ~70 ms of a start that is
~200 ms in all, and its per-symbol parsing took 25-40 s for
libtorch_cpu.so's 606k symbols, which is why the callers had grown their
own struct fast paths beside it. This reader reads only the byte ranges
asked for (`os.pread`: the header, the table of section headers, one
table's bytes), never the whole file: libcuda is 96 MB.

Files are opened by descriptor (O_RDONLY|O_CLOEXEC|O_NONBLOCK, so a FIFO
planted at a library's path does not block the open) and must be regular
files; `ElfFile.stat` is the fstat of that same descriptor, so a cache
keyed by (device, inode, mtime) describes the bytes that were parsed, not
whatever the path names a moment later. Bad or truncated input raises
ElfError (a ValueError), never struct.error or IndexError.
"""

from __future__ import annotations

import os
import stat as _stat
import struct
import zlib
from collections.abc import Iterator
from typing import NamedTuple

MAGIC = b"\x7fELF"

# e_ident[EI_CLASS], e_ident[EI_DATA], e_machine
ELFCLASS64 = 2
ELFDATA2LSB = 1
EM_X86_64 = 62
# sh_type
SHT_SYMTAB = 2
SHT_STRTAB = 3
SHT_RELA = 4
SHT_NOTE = 7
SHT_NOBITS = 8
SHT_REL = 9
SHT_DYNSYM = 11
# sh_flags
SHF_COMPRESSED = 0x800
# p_type
PT_LOAD = 1
PT_DYNAMIC = 2
PT_NOTE = 4
# st_info & 0xf / >> 4
STT_OBJECT = 1
STT_FUNC = 2
STT_TLS = 6
STT_GNU_IFUNC = 10
STB_LOCAL, STB_GLOBAL, STB_WEAK = 0, 1, 2
# notes, d_tag
NT_GNU_BUILD_ID = 3
DT_NULL, DT_STRTAB, DT_RPATH, DT_RUNPATH = 0, 5, 15, 29
ELFCOMPRESS_ZLIB = 1

# The sections a CFI unwinder reads (issue 22): `.eh_frame` and its
# binary-search table in the file itself, `.debug_frame` mostly in the
# separate debug file.
FRAME_SECTIONS = (".eh_frame", ".eh_frame_hdr", ".debug_frame")

_NOTE_MAX = 1 << 16  # a sane PT_NOTE: build-id notes are a few dozen bytes


class ElfError(ValueError):
    """Not an ELF file, or one whose structures point outside it."""


class Section(NamedTuple):
    ndx: int  # its index in the section header table (what sh_link and st_shndx name)
    name: str
    type: int
    flags: int
    addr: int  # sh_addr: where it is mapped (0 if it is not)
    offset: int  # sh_offset in the file
    size: int  # sh_size (of the compressed bytes, for SHF_COMPRESSED)
    link: int
    info: int
    addralign: int
    entsize: int


class Segment(NamedTuple):
    type: int
    flags: int
    offset: int
    vaddr: int
    paddr: int
    filesz: int
    memsz: int
    align: int


class Symbol(NamedTuple):
    name: str
    value: int
    size: int
    info: int  # type in the low 4 bits, binding in the high 4
    other: int
    shndx: int

    @property
    def type(self) -> int:
        return self.info & 0xF

    @property
    def bind(self) -> int:
        return self.info >> 4


class _Layout(NamedTuple):
    ehdr: struct.Struct  # from e_type on
    shdr: struct.Struct
    phdr: struct.Struct
    sym: struct.Struct
    dyn: struct.Struct
    chdr: struct.Struct
    rela: struct.Struct
    rel: struct.Struct
    word: str  # the prefix: '<' or '>'


_LAYOUTS: dict[tuple[int, int], _Layout] = {}


def _layout(cls: int, data: int) -> _Layout:
    got = _LAYOUTS.get((cls, data))
    if got is None:
        got = _LAYOUTS[cls, data] = _make_layout(cls, data)
    return got


def _make_layout(cls: int, data: int) -> _Layout:
    e = "<" if data == ELFDATA2LSB else ">"
    if cls == ELFCLASS64:
        return _Layout(
            struct.Struct(e + "HHIQQQIHHHHHH"),
            struct.Struct(e + "IIQQQQIIQQ"),
            struct.Struct(e + "IIQQQQQQ"),
            struct.Struct(e + "IBBHQQ"),
            struct.Struct(e + "qQ"),
            struct.Struct(e + "IIQQ"),
            struct.Struct(e + "QQq"),
            struct.Struct(e + "QQ"),
            e,
        )
    return _Layout(
        struct.Struct(e + "HHIIIIIHHHHHH"),
        struct.Struct(e + "IIIIIIIIII"),
        struct.Struct(e + "IIIIIIII"),
        struct.Struct(e + "IIIBBH"),
        struct.Struct(e + "iI"),
        struct.Struct(e + "III"),
        struct.Struct(e + "IIi"),
        struct.Struct(e + "II"),
        e,
    )


def open_fd(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of a regular file at path (links followed:
    sonames are links); OSError otherwise (ENOENT, a dir, a FIFO...)."""
    return _open(path)[0]


def _open(path: str | os.PathLike[str]) -> tuple[int, os.stat_result]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(f"{os.fspath(path)}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class ElfFile:
    """One ELF file (or an in-memory image: MiniDebugInfo). Parsed lazily:
    the header on creation, section and program headers when first asked.
    A context manager; `close()` closes the descriptor if it opened it."""

    def __init__(
        self,
        fd: int | None = None,
        *,
        data: bytes | None = None,
        name: str = "",
        owned: bool = False,
        st: os.stat_result | None = None,
    ):
        if (fd is None) == (data is None):
            raise TypeError("ElfFile takes an fd or data")
        self.name = name
        self._fd = fd
        self._data = data
        self._owned = owned
        if fd is not None and st is None:
            st = os.fstat(fd)
        self.stat: os.stat_result | None = st
        self.size = self.stat.st_size if self.stat is not None else len(data or b"")
        head = self.read(0, 64)  # e_ident and the rest of a 64-bit header: one read
        if len(head) < 16 or head[:4] != MAGIC:
            raise ElfError(f"{name or 'data'}: not an ELF file")
        self.elfclass, self.data_encoding = head[4], head[5]
        if self.elfclass not in (1, 2) or self.data_encoding not in (1, 2):
            raise ElfError(f"{name}: unknown ELF class {head[4]} or encoding {head[5]}")
        self._l = _layout(self.elfclass, self.data_encoding)
        if len(head) < 16 + self._l.ehdr.size:
            raise ElfError(f"{name}: truncated ELF header")
        (self.type, self.machine, _version, self.entry, self._phoff, self._shoff, _flags,
         _ehsize, self._phentsize, self._phnum, self._shentsize, self._shnum,
         self._shstrndx) = self._l.ehdr.unpack_from(head, 16)  # fmt: skip
        self._sections: list[Section] | None = None
        self._by_name: dict[str, Section] | None = None
        self._segments: list[Segment] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ElfFile:
        """Open path by descriptor (see open_fd). OSError, ElfError."""
        fd, st = _open(path)
        try:
            return cls(fd, name=os.fspath(path), owned=True, st=st)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "") -> ElfFile:
        return cls(data=data, name=name)

    def close(self) -> None:
        if self._owned and self._fd is not None:
            os.close(self._fd)
        self._fd = None
        self._owned = False

    def __enter__(self) -> ElfFile:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- bytes --------------------------------------------------------------

    def read(self, offset: int, size: int) -> bytes:
        """Up to size bytes at file offset (fewer at the end of the file)."""
        if offset < 0 or size < 0:
            raise ElfError(f"{self.name}: negative offset or size")
        if self._data is not None:
            return self._data[offset : offset + size]
        if self._fd is None:
            raise ValueError("read from a closed ElfFile")
        return os.pread(self._fd, size, offset)

    def _exact(self, offset: int, size: int, what: str) -> bytes:
        if offset + size > self.size:
            raise ElfError(f"{self.name}: {what} lies beyond the end of the file")
        b = self.read(offset, size)
        if len(b) != size:
            raise ElfError(f"{self.name}: {what} is truncated")
        return b

    # -- header facts -------------------------------------------------------

    @property
    def is_x86_64(self) -> bool:
        return (
            self.elfclass == ELFCLASS64
            and self.data_encoding == ELFDATA2LSB
            and self.machine == EM_X86_64
        )

    # -- sections -----------------------------------------------------------

    @property
    def sections(self) -> list[Section]:
        if self._sections is None:
            self._sections = self._read_sections()
        return self._sections

    def _read_sections(self) -> list[Section]:
        if not self._shoff:
            return []
        sh = self._l.shdr
        if self._shentsize < sh.size:
            raise ElfError(f"{self.name}: section header size {self._shentsize}")
        num, strndx = self._shnum, self._shstrndx
        first = None
        if num == 0 or strndx == 0xFFFF:  # SHN_XINDEX: the real counts are in section 0
            first = sh.unpack(self._exact(self._shoff, sh.size, "section header 0"))
            num = num or first[5]
            if strndx == 0xFFFF:
                strndx = first[6]
        raw = self._exact(self._shoff, num * self._shentsize, "section headers")
        hdrs = [sh.unpack_from(raw, i * self._shentsize) for i in range(num)]
        names = b""
        if 0 < strndx < num:
            h = hdrs[strndx]
            if h[1] != SHT_NOBITS:
                names = self._exact(h[4], h[5], "section name table")
        out = []
        for i, (nm, typ, fl, addr, off, size, link, info, align, ent) in enumerate(hdrs):
            end = names.find(b"\0", nm)
            name = names[nm : end if end >= 0 else None].decode("utf-8", "replace")
            out.append(Section(i, name, typ, fl, addr, off, size, link, info, align, ent))
        return out

    @property
    def sections_by_name(self) -> dict[str, Section]:
        """name -> section (the first of that name)."""
        if self._by_name is None:
            d: dict[str, Section] = {}
            for s in self.sections:
                d.setdefault(s.name, s)
            self._by_name = d
        return self._by_name

    def section(self, name: str) -> Section | None:
        return self.sections_by_name.get(name)

    def section_data(self, sec: Section | str) -> bytes:
        """A section's bytes, decompressed when SHF_COMPRESSED (zlib; zstd
        raises ElfError: Python's stdlib has no zstd before 3.14); b'' for
        SHT_NOBITS (.bss, or what a debug file left out) and for a name
        the file lacks."""
        if isinstance(sec, str):
            found = self.section(sec)
            if found is None:
                return b""
            sec = found
        if sec.type == SHT_NOBITS or not sec.size:
            return b""
        raw = self._exact(sec.offset, sec.size, f"section {sec.name}")
        if not sec.flags & SHF_COMPRESSED:
            return raw
        ch = self._l.chdr
        if len(raw) < ch.size:
            raise ElfError(f"{self.name}: section {sec.name}: truncated compression header")
        fields = ch.unpack_from(raw)
        ctype, csize = fields[0], fields[2] if self.elfclass == ELFCLASS64 else fields[1]
        if ctype != ELFCOMPRESS_ZLIB:
            raise ElfError(f"{self.name}: section {sec.name}: compression type {ctype}")

        try:
            out = zlib.decompress(raw[ch.size :])
        except zlib.error as e:
            raise ElfError(f"{self.name}: section {sec.name}: {e}") from None
        if len(out) != csize:
            raise ElfError(f"{self.name}: section {sec.name}: {len(out)} bytes, not {csize}")
        return out

    def frame_sections(self) -> dict[str, tuple[Section, bytes]]:
        """The call-frame sections this file has (FRAME_SECTIONS), each with
        its header (sh_addr: the address the CFI's pc-relative encodings
        are relative to) and its bytes, decompressed."""
        out = {}
        for name in FRAME_SECTIONS:
            sec = self.section(name)
            if sec is not None and sec.type != SHT_NOBITS:
                out[name] = (sec, self.section_data(sec))
        return out

    # -- segments -----------------------------------------------------------

    @property
    def segments(self) -> list[Segment]:
        if self._segments is None:
            self._segments = self._read_segments()
        return self._segments

    def _read_segments(self) -> list[Segment]:
        if not self._phoff or not self._phnum:
            return []
        ph = self._l.phdr
        if self._phentsize < ph.size:
            raise ElfError(f"{self.name}: program header size {self._phentsize}")
        raw = self._exact(self._phoff, self._phnum * self._phentsize, "program headers")
        out = []
        for i in range(self._phnum):
            f = ph.unpack_from(raw, i * self._phentsize)
            if self.elfclass == ELFCLASS64:
                typ, flags, off, vaddr, paddr, filesz, memsz, align = f
            else:
                typ, off, vaddr, paddr, filesz, memsz, flags, align = f
            out.append(Segment(typ, flags, off, vaddr, paddr, filesz, memsz, align))
        return out

    @property
    def loads(self) -> list[Segment]:
        return [s for s in self.segments if s.type == PT_LOAD]

    @property
    def first_load(self) -> int:
        """p_vaddr - p_offset of the lowest PT_LOAD: what a mapping's
        (address - file offset) is offset by when the file is loaded
        (0 for a shared library linked at 0; the link address of a
        non-PIE executable)."""
        loads = sorted((s.vaddr, s.offset) for s in self.loads)
        return loads[0][0] - loads[0][1] if loads else 0

    def vaddr_to_offset(self, vaddr: int) -> int | None:
        """The file offset of a virtual address, or None when no PT_LOAD
        holds it in its file bytes."""
        for s in self.loads:
            if s.vaddr <= vaddr < s.vaddr + s.filesz:
                return vaddr - s.vaddr + s.offset
        return None

    # -- notes --------------------------------------------------------------

    def notes(self) -> Iterator[tuple[bytes, int, bytes]]:
        """(name without its NUL, n_type, desc) of every note: from the
        PT_NOTE segments, or from the SHT_NOTE sections of a file without
        them (an object file; a debug file whose segments point at
        sections it no longer carries)."""
        found = False
        for off, size, align in self._note_segments():
            if 0 < size <= _NOTE_MAX and off + size <= self.size:
                found = True
                yield from _parse_notes(self.read(off, size), self._l.word, align)
        if found:
            return
        for sec in self.sections:
            if sec.type == SHT_NOTE and 0 < sec.size <= _NOTE_MAX:
                yield from _parse_notes(self.section_data(sec), self._l.word, sec.addralign)

    def _note_segments(self) -> list[tuple[int, int, int]]:
        """(p_offset, p_filesz, p_align) of the PT_NOTE segments. On the warm
        start's path (the build-id before every cache lookup): read from the
        raw headers of a 64-bit file without making a Segment of each."""
        if self._segments is not None or self.elfclass != ELFCLASS64:
            return [(s.offset, s.filesz, s.align) for s in self.segments if s.type == PT_NOTE]
        if not self._phoff or not self._phnum or self._phentsize < self._l.phdr.size:
            return [] if not self._phnum else [(s.offset, s.filesz, s.align) for s in self.segments]
        raw = self._exact(self._phoff, self._phnum * self._phentsize, "program headers")
        unpack, step = self._l.phdr.unpack_from, self._phentsize
        out = []
        for i in range(self._phnum):
            typ, _fl, off, _va, _pa, filesz, _mem, align = unpack(raw, i * step)
            if typ == PT_NOTE:
                out.append((off, filesz, align))
        return out

    @property
    def build_id(self) -> str:
        """The GNU build-id as hex, '' when the file has none."""
        for name, typ, desc in self.notes():
            if typ == NT_GNU_BUILD_ID and name == b"GNU" and desc:
                return desc.hex()
        return ""

    # -- debug links --------------------------------------------------------

    @property
    def debuglink(self) -> str:
        """The file name `.gnu_debuglink` names, '' when there is none."""
        data = self.section_data(".gnu_debuglink")
        return data.split(b"\0", 1)[0].decode("utf-8", "replace")

    def minidebuginfo(self) -> ElfFile | None:
        """The xz-compressed ELF in `.gnu_debugdata` (MiniDebugInfo: the
        local functions' `.symtab`), or None when there is none or it does
        not decompress to an ELF file."""
        data = self.section_data(".gnu_debugdata")
        if not data:
            return None
        # lazy: lzma (+2 modules) only for a file with MiniDebugInfo, not on
        # a warm trace's way to its probes (its symbol tables are cached)
        import lzma

        try:
            return ElfFile.from_bytes(lzma.decompress(data), f"{self.name}[.gnu_debugdata]")
        except (lzma.LZMAError, ElfError):
            return None

    # -- symbols ------------------------------------------------------------

    def _string_table(self, index: int) -> bytes:
        secs = self.sections
        if not 0 < index < len(secs):
            raise ElfError(f"{self.name}: string table index {index}")
        return self.section_data(secs[index])

    def symbols(self, table: str | Section = ".symtab") -> Iterator[Symbol]:
        """Every entry of a symbol table (by name or header), entry 0 too."""
        sec = self.section(table) if isinstance(table, str) else table
        if sec is None or sec.type not in (SHT_SYMTAB, SHT_DYNSYM):
            return
        sym = self._l.sym
        data, strtab = self._table_bytes(sec)
        six4 = self.elfclass == ELFCLASS64
        for f in sym.iter_unpack(data):
            if six4:
                st_name, info, other, shndx, value, size = f
            else:
                st_name, value, size, info, other, shndx = f
            end = strtab.find(b"\0", st_name)
            name = strtab[st_name : end if end >= 0 else None].decode("utf-8", "replace")
            yield Symbol(name, value, size, info, other, shndx)

    def _table_bytes(self, sec: Section) -> tuple[bytes, bytes]:
        sym = self._l.sym
        if sec.entsize != sym.size:
            raise ElfError(f"{self.name}: {sec.name} entries of {sec.entsize} bytes")
        data = self.section_data(sec)
        data = data[: len(data) - len(data) % sym.size]
        return data, self._string_table(sec.link)

    def functions(
        self, table: str = ".symtab", types: tuple[int, ...] = (STT_FUNC, STT_GNU_IFUNC)
    ) -> list[tuple[str, int, int, int]]:
        """(name, st_value, st_size, st_info) of the defined functions of a
        table: a type in `types`, a section index other than SHN_UNDEF, a
        non-zero value. The hot loop of a cold start (libtorch_cpu.so:
        606k symbols), so names are decoded only for the entries kept."""
        sec = self.section(table)
        if sec is None or sec.type not in (SHT_SYMTAB, SHT_DYNSYM) or not sec.size:
            return []
        data, strtab = self._table_bytes(sec)
        out = []
        find = strtab.find
        # One loop per class, unpacked in place: the fastest of the variants
        # measured (a frozenset of st_info values, the string table decoded
        # once, a comprehension: none was faster on libtorch_cpu.so).
        if self.elfclass == ELFCLASS64:
            for st_name, info, _o, shndx, value, size in self._l.sym.iter_unpack(data):
                if info & 0xF not in types or not shndx or not value:
                    continue
                end = find(b"\0", st_name)
                name = strtab[st_name : end if end >= 0 else None].decode("utf-8", "replace")
                out.append((name, value, size, info))
        else:
            for st_name, value, size, info, _o, shndx in self._l.sym.iter_unpack(data):
                if info & 0xF not in types or not shndx or not value:
                    continue
                end = find(b"\0", st_name)
                name = strtab[st_name : end if end >= 0 else None].decode("utf-8", "replace")
                out.append((name, value, size, info))
        return out

    # -- relocations --------------------------------------------------------

    def relocations(self, sec: Section | str) -> list[tuple[int, int, int, int]]:
        """(r_offset, symbol index, relocation type, r_addend) of a SHT_RELA
        or SHT_REL section (addend 0 for REL); [] for any other section."""
        if isinstance(sec, str):
            found = self.section(sec)
            if found is None:
                return []
            sec = found
        if sec.type not in (SHT_RELA, SHT_REL):
            return []
        st = self._l.rela if sec.type == SHT_RELA else self._l.rel
        if sec.entsize != st.size:
            raise ElfError(f"{self.name}: {sec.name} entries of {sec.entsize} bytes")
        data = self.section_data(sec)
        shift, mask = (32, 0xFFFFFFFF) if self.elfclass == ELFCLASS64 else (8, 0xFF)
        out = []
        for r in st.iter_unpack(data[: len(data) - len(data) % st.size]):
            out.append((r[0], r[1] >> shift, r[1] & mask, r[2] if len(r) > 2 else 0))
        return out

    # -- dynamic section ----------------------------------------------------

    def dynamic(self) -> list[tuple[int, int]]:
        """(d_tag, d_val) of the `.dynamic` section, up to DT_NULL."""
        sec = self.section(".dynamic")
        if sec is None:
            return []
        out = []
        for tag, val in self._l.dyn.iter_unpack(
            (d := self.section_data(sec))[: len(d) - len(d) % self._l.dyn.size]
        ):
            if tag == DT_NULL:
                break
            out.append((tag, val))
        return out

    def runpath(self) -> list[str]:
        """The directories of DT_RUNPATH, or of DT_RPATH when there is no
        RUNPATH (as ld.so does), unexpanded ($ORIGIN stays)."""
        sec = self.section(".dynamic")
        if sec is None:
            return []
        tags = self.dynamic()
        strtab = self._string_table(sec.link)
        for want in (DT_RUNPATH, DT_RPATH):
            for tag, val in tags:
                if tag == want:
                    end = strtab.find(b"\0", val)
                    s = strtab[val : end if end >= 0 else None].decode("utf-8", "replace")
                    return [d for d in s.split(":") if d]
        return []


def _parse_notes(data: bytes, e: str, align: int) -> Iterator[tuple[bytes, int, bytes]]:
    # Notes are 4-byte aligned, except in a segment or section aligned to 8
    # (.note.gnu.property), as readelf and the kernel read them.
    a = 7 if align == 8 else 3
    pos = 0
    hdr = struct.Struct(e + "III")
    while pos + 12 <= len(data):
        namesz, descsz, ntype = hdr.unpack_from(data, pos)
        name_at = pos + 12
        desc_at = name_at + (namesz + a & ~a)
        if desc_at + descsz > len(data):
            return
        yield (
            data[name_at : name_at + namesz].rstrip(b"\0"),
            ntype,
            data[desc_at : desc_at + descsz],
        )
        pos = desc_at + (descsz + a & ~a)


def kind(path: str | os.PathLike[str]) -> str:
    """'x86-64' for an x86-64 (64-bit little-endian) ELF file, 'elf' for
    another ELF, '' for anything else (a linker script such as libc.so, a
    text file, a dir, a FIFO, a file we cannot read)."""
    try:
        with ElfFile.open(path) as f:
            return "x86-64" if f.is_x86_64 else "elf"
    except (OSError, ElfError):
        return ""


def build_id(path: str | os.PathLike[str]) -> str:
    """The GNU build-id of the file at path as hex; '' when it has none or
    is no ELF file. On the warm start's path: three preads (the header, the
    program headers, the note), no section table."""
    try:
        with ElfFile.open(path) as f:
            return f.build_id
    except (OSError, ElfError):
        return ""
