"""pyctl/elf.py, the one ELF reader: against binutils' readelf on real
system binaries (sections, segments, build-id, symbol tables, RUNPATH),
its MiniDebugInfo and compressed-section reading against objcopy and xz,
its refusals, and a check that no other module of pyctl parses ELF itself
(struct layouts of ELF headers, the magic, pyelftools)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyctl import elf

REPO = Path(__file__).resolve().parent.parent
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
BPF_OBJ = REPO / "pyctl" / "data" / "gpufault.bpf.o"
DOUBLE_INFER = REPO / "pyctl" / "data" / "doubles" / "gf-infer"

needs_readelf = pytest.mark.skipif(not shutil.which("readelf"), reason="needs readelf (binutils)")


def _tokenizers_so() -> str | None:
    try:
        import tokenizers
    except ImportError:
        return None
    d = Path(tokenizers.__file__).parent
    hits = sorted(d.glob("tokenizers*.so"))
    return str(hits[0]) if hits else None


def _files() -> list[str]:
    out = [LIBC, LIBSTDCXX, "/bin/ls", str(BPF_OBJ)]
    tok = _tokenizers_so()
    if tok:
        out.append(tok)
    dbg = sorted(Path("/usr/lib/debug/.build-id").glob("*/*.debug"))
    if dbg:
        out.append(str(dbg[0]))  # a separate debug file: .eh_frame and most else NOBITS
    return [p for p in out if os.path.exists(p)]


def readelf(*args: str) -> str:
    r = subprocess.run(["readelf", "-W", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _num(s: str) -> int:
    return int(s, 16) if s.startswith("0x") else int(s)


# ---- against readelf --------------------------------------------------------


_SEC = re.compile(
    r"^\s*\[\s*(\d+)\]\s(.{17,}?)\s+([A-Z_0-9]+|LOOS\+\w+|<unknown>: \w+)\s+"
    r"([0-9a-f]{8,16})\s([0-9a-f]{6,})\s([0-9a-f]{6,})\s"
)


@needs_readelf
@pytest.mark.parametrize("path", _files())
def test_sections_and_segments_match_readelf(path: str) -> None:
    with elf.ElfFile.open(path) as f:
        secs = f.sections
        segs = f.segments
    want = []
    for line in readelf("-S", path).splitlines():
        m = _SEC.match(line)
        if m:
            want.append((int(m[1]), m[2].strip(), int(m[4], 16), int(m[5], 16), int(m[6], 16)))
    assert len(want) == len(secs) > 5
    got = [(s.ndx, s.name, s.addr, s.offset, s.size) for s in secs]
    assert got == want
    phdrs = []
    for line in readelf("-l", path).splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1].startswith("0x") and parts[2].startswith("0x"):
            phdrs.append((parts[0], *(int(x, 16) for x in parts[1:6])))
    mine = [(s.offset, s.vaddr, s.paddr, s.filesz, s.memsz) for s in segs]
    assert [p[1:] for p in phdrs] == mine
    loads = [p for p in phdrs if p[0] == "LOAD"]
    assert [(s.offset, s.vaddr, s.filesz) for s in f.loads] == [(p[1], p[2], p[4]) for p in loads]
    if loads:
        low = min(loads, key=lambda p: p[2])
        assert f.first_load == low[2] - low[1]


@needs_readelf
@pytest.mark.parametrize("path", _files())
def test_build_id_matches_readelf(path: str) -> None:
    m = re.search(r"Build ID: ([0-9a-f]+)", readelf("-n", path))
    assert elf.build_id(path) == (m[1] if m else "")


def _readelf_symbols(path: str) -> dict[str, list[tuple[int, int, str, str, str, str]]]:
    """table -> (value, size, type, bind, ndx, name without @version)."""
    out: dict[str, list[tuple[int, int, str, str, str, str]]] = {}
    cur = None
    for line in readelf("-s", "--dyn-syms", path).splitlines():
        m = re.match(r"Symbol table '([^']+)' contains (\d+) entries", line)
        if m:
            cur = out.setdefault(m[1], [])
            continue
        parts = line.split(None, 7)
        if cur is None or len(parts) < 7 or not parts[0].rstrip(":").isdigit():
            continue
        name = parts[7] if len(parts) == 8 else ""
        name = re.sub(r" \(\d+\)$", "", name).split("@")[0]
        cur.append((int(parts[1], 16), _num(parts[2]), parts[3], parts[4], parts[6], name))
    return out


_TYPES = {0: "NOTYPE", 1: "OBJECT", 2: "FUNC", 3: "SECTION", 4: "FILE", 6: "TLS", 10: "IFUNC"}
_BINDS = {0: "LOCAL", 1: "GLOBAL", 2: "WEAK", 10: "UNIQUE"}
_NDX = {0: "UND", 0xFFF1: "ABS", 0xFFF2: "COM"}


@needs_readelf
@pytest.mark.parametrize("path", _files())
def test_symbol_tables_match_readelf(path: str) -> None:
    want = _readelf_symbols(path)
    with elf.ElfFile.open(path) as f:
        secs = f.sections
        for table in (".symtab", ".dynsym"):
            got = [
                (s.value, s.size, _TYPES.get(s.type, "?"), _BINDS.get(s.bind, "?"),
                 _NDX.get(s.shndx, str(s.shndx)),
                 # readelf names an unnamed STT_SECTION symbol after its section
                 secs[s.shndx].name if s.type == 3 and not s.name else s.name.split("@")[0])
                for s in f.symbols(table)
            ]  # fmt: skip
            assert got == want.get(table, [])
            # functions(): the defined FUNC and IFUNC entries with an address.
            funcs = sorted((n.split("@")[0], v, sz) for n, v, sz, _i in f.functions(table))
            ref = sorted(
                (w[5], w[0], w[1]) for w in want.get(table, [])
                if w[2] in ("FUNC", "IFUNC") and w[4] != "UND" and w[0]
            )  # fmt: skip
            assert funcs == ref
    assert sum(len(v) for v in want.values()) > 0


@needs_readelf
@pytest.mark.parametrize("path", [LIBC, LIBSTDCXX])
def test_relocations_match_readelf(path: str) -> None:
    want: dict[str, list[tuple[int, int, int, int]]] = {}
    cur = None
    for line in readelf("-r", path).splitlines():
        m = re.match(r"Relocation section '([^']+)'", line)
        if m:
            cur = want.setdefault(m[1], [])
            continue
        t = line.split()
        if cur is None or len(t) < 3 or not re.fullmatch(r"[0-9a-f]{16}", t[0]):
            continue
        if len(t) >= 6 and t[-2] in "+-":  # symbol + addend
            addend = int(t[-1], 16) * (-1 if t[-2] == "-" else 1)
        else:
            addend = int(t[-1], 16) if len(t) == 4 else 0
        info = int(t[1], 16)
        cur.append((int(t[0], 16), info >> 32, info & 0xFFFFFFFF, addend))
    assert want
    with elf.ElfFile.open(path) as f:
        for name, rows in want.items():
            assert f.relocations(name) == rows, name
        assert f.relocations(".dynsym") == []


@needs_readelf
def test_runpath_matches_readelf() -> None:
    if not DOUBLE_INFER.exists():
        pytest.skip("pyctl/data/doubles/gf-infer missing: run make build")
    m = re.search(r"\((?:RUNPATH|RPATH)\)\s+Library (?:runpath|rpath): \[([^\]]*)\]",
                  readelf("-d", str(DOUBLE_INFER)))  # fmt: skip
    assert m, "the double's workload is linked with a RUNPATH"
    with elf.ElfFile.open(DOUBLE_INFER) as f:
        assert f.runpath() == m[1].split(":") == ["$ORIGIN"]
    with elf.ElfFile.open(LIBC) as f:
        assert f.runpath() == []


def test_frame_sections_give_bytes_and_addresses() -> None:
    """What a CFI unwinder needs (issue 22): .eh_frame_hdr's version byte
    is 1 and its eh_frame_ptr, pc-relative to its own address, points at
    .eh_frame's sh_addr."""
    import struct

    with elf.ElfFile.open(LIBC) as f:
        fr = f.frame_sections()
        hdr_sec, hdr = fr[".eh_frame_hdr"]
        eh_sec, eh = fr[".eh_frame"]
        assert len(hdr) == hdr_sec.size and len(eh) == eh_sec.size
        assert f.sections_by_name[".eh_frame"] == eh_sec
        version, ptr_enc = hdr[0], hdr[1]
        assert version == 1 and ptr_enc == 0x1B  # DW_EH_PE_pcrel | DW_EH_PE_sdata4
        (rel,) = struct.unpack_from("<i", hdr, 4)
        assert hdr_sec.addr + 4 + rel == eh_sec.addr
        assert f.section_data(".eh_frame") == eh == f.read(eh_sec.offset, eh_sec.size)


# ---- MiniDebugInfo, compressed sections ----------------------------------------

needs_cc = pytest.mark.skipif(
    not (shutil.which("gcc") and shutil.which("objcopy") and shutil.which("xz")),
    reason="needs gcc, objcopy and xz",
)
_SRC = "static int __attribute__((noinline)) hidden_local(int x) { return x * 3; }\n" \
       "int visible(int x) { return hidden_local(x) + 1; }\n"  # fmt: skip


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)


@needs_cc
def test_minidebuginfo_is_read(tmp_path: Path) -> None:
    """Fedora's layout: the file is stripped, the local functions' .symtab
    rides in .gnu_debugdata as an xz-compressed ELF; symtab names a frame in
    a local function from it."""
    from pyctl.symbols import symtab

    src = tmp_path / "m.c"
    src.write_text(_SRC)
    full, lib = tmp_path / "full.so", tmp_path / "libm1.so"
    _run("gcc", "-O2", "-shared", "-fPIC", "-o", str(full), str(src))
    _run("objcopy", "--only-keep-debug", str(full), str(tmp_path / "mini"))
    _run("xz", "-k", str(tmp_path / "mini"))
    _run("objcopy", "--strip-all", "--add-section", f".gnu_debugdata={tmp_path / 'mini.xz'}",
         str(full), str(lib))  # fmt: skip
    with elf.ElfFile.open(lib) as f:
        assert f.section(".symtab") is None
        mini = f.minidebuginfo()
        assert mini is not None
        names = {n for n, *_ in mini.functions(".symtab")}
        assert {"hidden_local", "visible"} <= names
        (value,) = [v for n, v, *_ in mini.functions(".symtab") if n == "hidden_local"]
    t = symtab.load(str(lib))
    assert "gnu_debugdata" in t.sources
    assert t.lookup(value) == ("hidden_local", 0)
    # Garbage in .gnu_debugdata is no MiniDebugInfo, not an error.
    (tmp_path / "junk").write_bytes(b"not xz at all")
    bad = tmp_path / "libbad.so"
    _run("objcopy", "--strip-all", "--add-section", f".gnu_debugdata={tmp_path / 'junk'}",
         str(full), str(bad))  # fmt: skip
    with elf.ElfFile.open(bad) as f:
        assert f.minidebuginfo() is None


@needs_cc
def test_compressed_sections_are_decompressed(tmp_path: Path) -> None:
    src = tmp_path / "c.c"
    src.write_text(_SRC)
    z, plain = tmp_path / "z.o", tmp_path / "plain.o"
    _run("gcc", "-g", "-c", "-o", str(z), str(src))
    _run("objcopy", "--compress-debug-sections=zlib-gabi", str(z))
    _run("objcopy", "--decompress-debug-sections", str(z), str(plain))
    with elf.ElfFile.open(z) as fz, elf.ElfFile.open(plain) as fp:
        info = fz.section(".debug_info")
        assert info is not None and info.flags & elf.SHF_COMPRESSED
        want = fp.section_data(".debug_info")
        assert len(want) > info.size - 24  # it really was compressed
        assert fz.section_data(".debug_info") == want
        # An object file has no PT_NOTE: notes come from its sections.
        assert fz.segments == []


# ---- refusals -----------------------------------------------------------------


def test_bad_input_is_elferror_or_oserror(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("not an ELF file at all")
    assert elf.kind(text) == "" and elf.build_id(text) == ""
    with pytest.raises(elf.ElfError):
        elf.ElfFile.open(text)
    # libc.so is a linker script on Debian.
    assert elf.kind("/usr/lib/x86_64-linux-gnu/libc.so") in ("", "elf")
    assert elf.kind(LIBC) == "x86-64" and elf.kind(BPF_OBJ) == "elf"
    # A truncated copy: header fine, section headers beyond the end.
    cut = tmp_path / "cut.so"
    cut.write_bytes(Path(LIBC).read_bytes()[:4096])
    with elf.ElfFile.open(cut) as f:
        with pytest.raises(elf.ElfError, match="beyond the end"):
            f.sections  # noqa: B018
    # A FIFO at the path neither blocks the open nor counts as a file.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError):
        elf.ElfFile.open(fifo)
    assert elf.kind(fifo) == "" and elf.build_id(tmp_path) == ""


def test_stat_is_of_the_descriptor_read(tmp_path: Path) -> None:
    p = tmp_path / "lib.so"
    shutil.copy2(LIBC, p)
    with elf.ElfFile.open(p) as f:
        before = f.stat
        assert before is not None
        p.unlink()
        shutil.copy2(LIBSTDCXX, p)  # another file at the same path now
        assert (before.st_dev, before.st_ino) != (os.stat(p).st_dev, os.stat(p).st_ino)
        assert f.build_id == elf.build_id(LIBC)  # still the bytes first opened


# ---- nobody else parses ELF ----------------------------------------------------

# The struct layouts of ELF headers and entries (64- and 32-bit), without
# their byte-order prefix: Ehdr after e_ident, Shdr, Phdr (or a prefix of
# it, as diskcache's build-id reader used), Sym, Dyn, Rela.
_ELF_FORMATS = {
    "HHIQQQIHHHHHH", "HHIIIIIHHHHHH", "IIQQQQIIQQ", "IIIIIIIIII", "IIQQQQQQ", "IIQQQQ",
    "IIIIIIII", "IBBHQQ", "IIIBBH", "qQ", "QQq",
}  # fmt: skip
# pyelftools' dict keys and the C names: code that reads an ELF structure
# field by name.
_ELF_FIELDS = {
    "e_phoff", "e_shoff", "e_phnum", "e_shnum", "sh_offset", "sh_type", "sh_addr", "sh_link",
    "sh_entsize", "p_type", "p_vaddr", "p_offset", "p_filesz", "p_memsz", "st_info",
    "st_value", "st_size", "st_shndx", "n_type", "n_desc", "d_tag",
}  # fmt: skip
_STRUCT_CALLS = {"unpack", "unpack_from", "iter_unpack", "Struct", "calcsize"}


def elf_parsing(source: str) -> list[str]:
    """What in a module's source reads ELF by itself: an elftools import,
    the ELF magic, a struct format of an ELF structure, an ELF field name."""
    out = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            out += [
                f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] == "elftools"
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "elftools":
            out.append(f"{line}: from {node.module} import")
        elif isinstance(node, ast.Constant) and isinstance(node.value, (bytes, str)):
            v = (
                node.value
                if isinstance(node.value, bytes)
                else node.value.encode("latin-1", "replace")
            )
            if b"\x7fELF" in v:
                out.append(f"{line}: the ELF magic")
            elif isinstance(node.value, str) and node.value in _ELF_FIELDS:
                out.append(f"{line}: ELF field {node.value!r}")
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in _STRUCT_CALLS and node.args and isinstance(node.args[0], ast.Constant):
                fmt = str(node.args[0].value).lstrip("<>=!@")
                if fmt in _ELF_FORMATS:
                    out.append(f"{line}: struct format {node.args[0].value!r}")
    return out


def test_the_checker_finds_the_readers_it_replaced() -> None:
    """The check can fail: the struct readers this reader replaced
    (diskcache's build-id, libbpf's .symtab, resolve's elf_kind) and a
    pyelftools import are each caught."""
    old = [
        'import struct\nstruct.unpack_from("<IIQQQQ", b, 0)\n',
        'def f(d):\n    for x in struct.iter_unpack("<IBBHQQ", d): pass\n',
        'if head[:4] != b"\\x7fELF":\n    pass\n',
        "from elftools.elf.elffile import ELFFile\n",
        'x = s["p_vaddr"]\n',
        "import elftools\n",
    ]
    for src in old:
        assert elf_parsing(src), src
    assert elf_parsing((REPO / "pyctl" / "elf.py").read_text())  # the reader itself would be
    assert not elf_parsing('struct.unpack("<QQ", b)\nx = "p_vaddr_of"\n')


def test_no_module_outside_the_reader_parses_elf() -> None:
    bad = {}
    files = sorted((REPO / "pyctl").rglob("*.py"))
    assert len(files) > 100
    for p in files:
        if p == REPO / "pyctl" / "elf.py":
            continue
        hits = elf_parsing(p.read_text())
        if hits:
            bad[str(p.relative_to(REPO))] = hits
    assert not bad, bad


def test_the_reader_imports_nothing_slow() -> None:
    """It is on every start's path (the build-id before each cache lookup,
    the BPF object's .symtab): the standard library's os, stat and struct
    only, lzma and zlib where a file needs them."""
    code = (
        "import sys; pre = set(sys.modules); import pyctl.elf as e\n"
        f"e.build_id({LIBC!r}); e.ElfFile.open({LIBC!r}).sections\n"
        "print(sorted(m for m in set(sys.modules) - pre if not m.startswith('pyctl')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out
