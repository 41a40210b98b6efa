"""Stack frames name the right function: pyctl/symbols/symtab.py against gdb as
the oracle (gdb reads the same .symtab/.dynsym and debug files by build-id),
on random addresses of real files: Debian's libc (its local functions, such
as start_thread, come from libc6-dbg's debug file), a C++ program with a
namespace and a class template, and HF tokenizers' Rust extension.

Where gdb stretches a symbol of size 0 (crt's register_tm_clones) to the
next symbol, symtab says nothing: an unknown extent is not a name."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from pyctl.symbols import symtab
from pyctl.symbols.demangle import demangle

REPO = Path(__file__).resolve().parent.parent
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
CXX = REPO / "build" / "targets" / "gf_cxx"


def _text_range(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        t = ELFFile(f).get_section_by_name(".text")
        return t["sh_addr"], t["sh_addr"] + t["sh_size"]


def _zero_sized(path: str) -> set[str]:
    out = set()
    with open(path, "rb") as f:
        for sec in ELFFile(f).iter_sections():
            if isinstance(sec, SymbolTableSection):
                out |= {s.name for s in sec.iter_symbols() if s["st_size"] == 0}
    return out


def _gdb(path: str, addrs: list[int]) -> list[tuple[str, int] | None]:
    cmd = ["gdb", "-batch", "-nx", "-ex", "set print asm-demangle on"]
    for a in addrs:
        cmd += ["-ex", f"info symbol {a:#x}"]
    out = subprocess.run([*cmd, path], capture_output=True, text=True, timeout=300).stdout
    lines = [ln for ln in out.splitlines() if " in section " in ln or ln.startswith("No symbol")]
    assert len(lines) == len(addrs)
    res: list[tuple[str, int] | None] = []
    for ln in lines:
        m = re.match(r"(.*?)(?: \+ (\d+))? in section", ln)
        res.append(
            None if ln.startswith("No symbol") or not m else (m.group(1), int(m.group(2) or 0))
        )
    return res


def _ours(path: str, addr: int) -> tuple[str, int] | None:
    got = symtab.name_at(path, addr)
    if got is None:
        return None
    name, off = got.split("!", 1)[1].rsplit("+", 1)
    return name, int(off, 16)


@pytest.mark.parametrize("which", ["libc", "c++", "rust"])
def test_frames_agree_with_gdb(which: str) -> None:
    if shutil.which("gdb") is None:
        pytest.skip("gdb missing: apt-get install gdb (make setup does)")
    if which == "libc":
        path = LIBC
    elif which == "c++":
        path = str(CXX)
        if not CXX.exists():
            pytest.skip("build/targets/gf_cxx missing: run make build")
    else:
        mod = pytest.importorskip("tokenizers.tokenizers")
        path = mod.__file__
    lo, hi = _text_range(path)
    rng = random.Random(7)
    addrs = [rng.randrange(lo, hi) for _ in range(200)]
    zero = {demangle(n) for n in _zero_sized(path)}
    named = 0
    for a, g in zip(addrs, _gdb(path, addrs), strict=True):
        o = _ours(path, a)
        if g is not None and g[0] in zero and g[1] > 0:
            assert o is None, (hex(a), g, o)  # unknown extent: no name
            continue
        assert (o is None) == (g is None), (hex(a), g, o)
        if o is not None and g is not None:
            assert o[1] == g[1], (hex(a), g, o)
            if which != "rust":  # gdb spells Rust v0 names its own way
                # Aliases (two names, one start): gdb's pick may be another.
                t = symtab.load(path)
                start = a - o[1] - t.first_load
                # gdb also drops a last clone number (x.constprop.0 -> x.constprop).
                # and writes a .cold part as x[cold].
                ok = {
                    o[0],
                    re.sub(r"\.\d+$", "", o[0]),
                    re.sub(r"\.cold$", "[cold]", o[0]),
                    *map(demangle, t.aliases(start)),
                }
                assert g[0] in ok, (hex(a), g, o)
            assert not o[0].startswith(("_Z", "_R")), o  # demangled
            named += 1
    assert named > 20


def test_libc_thread_frame_is_start_thread_not_its_exported_neighbour() -> None:
    t = symtab.load(LIBC)
    if not any(s not in ("symtab", "dynsym") for s in t.sources):
        pytest.skip("no libc debug file: apt-get install libc6-dbg (make setup does)")
    start = t.starts[t.names.index("start_thread")]
    assert symtab.name_at(LIBC, start + 0x305) == "libc.so.6!start_thread+0x305"


def test_an_address_in_no_function_has_no_name(tmp_path: Path) -> None:
    if not CXX.exists():
        pytest.skip("build/targets/gf_cxx missing: run make build")
    t = symtab.load(str(CXX))
    i = t.names.index("_Z3fooi")
    assert symtab.name_at(str(CXX), t.starts[i] + 1) == "gf_cxx!foo(int)+0x1"
    assert symtab.name_at(str(CXX), t.ends[i] + 0x10_0000) is None  # far past every function
    box = [n for n in t.names if "Box" in n]
    assert [demangle(n) for n in box] == ["gfns::Box<int>::get(int) const [clone .isra.0]"]


def test_demangling() -> None:
    assert (
        demangle("_ZN3c104cuda20CUDACachingAllocator3getEv")
        == "c10::cuda::CUDACachingAllocator::get()"
    )
    assert demangle("_Z3fooi") == "foo(int)"
    assert demangle("_ZN4core3fmt5write17h0123456789abcdefE") == "core::fmt::write"
    assert demangle("_RNvCsp0gl3UJkm_8tiktoken16byte_pair_encode") == "tiktoken::byte_pair_encode"
    assert (
        demangle("_RNvCsp0gl3UJkm_8tiktoken16byte_pair_encode.llvm.123")
        == "tiktoken::byte_pair_encode [clone .llvm.123]"
    )
    assert demangle("malloc") == "malloc"
    assert demangle("_Znot-a-name") == "_Znot-a-name"
