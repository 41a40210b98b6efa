"""pyctl/bpf/names.py against the built objects' symbol tables, and every
map/program/variable name pyctl passes to libbpf against names.py. No
root: the ELF symbol table is read from the file."""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import pytest

from pyctl.bpf import names

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "pyctl" / "data"
# Calls whose first argument names a map, a program or a variable.
NAME_CALLS = {
    "map_fd",
    "map",
    "program",
    "attach",
    "set_autoload",
    "set_max_entries",
    "set_expected_attach_type",
    "attach_uprobe",
    "attach_uprobe_multi",
}
# bpf/aggregate.bpf.c's loader names its own object (pyctl/bpf/aggregate_abi.py).
NOT_OURS = {"aggregate.py"}


def elf_symbols(path: Path) -> dict[str, set[str]]:
    """Global FUNC and OBJECT symbols of an ELF64 little-endian object, by
    the name of the section they are in."""
    b = path.read_bytes()
    assert b[:4] == b"\x7fELF" and b[4] == 2 and b[5] == 1, path
    (shoff,) = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]

    def cstr(off: int) -> str:
        return b[off : b.index(b"\0", off)].decode()

    shstr = secs[shstrndx][4]
    sec_names = [cstr(shstr + s[0]) for s in secs]
    out: dict[str, set[str]] = {}
    for s in secs:
        if s[1] != 2:  # SHT_SYMTAB
            continue
        strtab = secs[s[6]][4]
        for i in range(s[5] // 24):
            st_name, st_info, _, st_shndx, _, _ = struct.unpack_from("<IBBHQQ", b, s[4] + i * 24)
            bind, typ = st_info >> 4, st_info & 0xF
            if bind == 1 and typ in (1, 2) and 0 < st_shndx < len(sec_names):  # GLOBAL OBJECT/FUNC
                out.setdefault(sec_names[st_shndx], set()).add(cstr(strtab + st_name))
    return out


@pytest.mark.parametrize("ns", names.OBJECTS, ids=lambda ns: ns.OBJECT)
def test_names_match_the_built_object(ns: type) -> None:
    obj = DATA / ns.OBJECT
    if not obj.exists():
        pytest.skip(f"{obj} missing: run make build")
    syms = elf_symbols(obj)
    programs = {
        n
        for sec, ss in syms.items()
        if sec not in {".maps", ".rodata", ".data", ".bss", "license", ".text"}
        for n in ss
    }
    assert set(ns.MAPS) == syms.get(".maps", set())
    assert set(ns.PROGRAMS) == programs
    assert set(ns.RODATA) <= syms.get(".rodata", set())


_NAMESPACES = {ns.__name__: ns for ns in names.OBJECTS}


def _name_of(node: ast.expr) -> str | None:
    """A literal string, or a names.py constant (`Main.EVENTS`,
    `names.Main.EVENTS`) as its string: both are names handed to libbpf."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Attribute):
        owner = node.value
        if isinstance(owner, ast.Attribute):  # names.Main.X
            owner = ast.Name(owner.attr)
        if isinstance(owner, ast.Name) and owner.id in _NAMESPACES:
            value = getattr(_NAMESPACES[owner.id], node.attr, None)
            # An unknown constant: reported as such, never skipped.
            return value if isinstance(value, str) else f"{owner.id}.{node.attr}?"
    return None


def _literals_named_in_pyctl() -> list[tuple[str, int, str]]:
    """(file, line, string) of every name handed to libbpf: a literal or a
    names.py constant."""
    found = []
    for p in sorted((REPO / "pyctl").rglob("*.py")):
        if p.name in NOT_OURS:
            continue
        tree = ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            attr = node.func.attr
            args = node.args
            if attr in NAME_CALLS and args and (name := _name_of(args[0])) is not None:
                found.append((str(p.relative_to(REPO)), node.lineno, name))
            if attr == "set_rodata" and args and isinstance(args[0], ast.Dict):
                found.extend(
                    (str(p.relative_to(REPO)), node.lineno, name)
                    for k in args[0].keys
                    if k is not None and (name := _name_of(k)) is not None
                )
    return found


def test_every_name_pyctl_hands_to_libbpf_is_in_names() -> None:
    known = {n for ns in names.OBJECTS for n in (*ns.MAPS, *ns.PROGRAMS, *ns.RODATA)}
    found = _literals_named_in_pyctl()
    assert len(found) > 10  # the scan sees the engine's, xid's and the trial loads' names
    unknown = [f"{f}:{ln}: {s!r}" for f, ln, s in found if s not in known and s != ".rodata"]
    assert not unknown, "names not in pyctl/bpf/names.py:\n" + "\n".join(unknown)


def test_capabilities_programs_are_the_engines() -> None:
    from pyctl import capabilities

    assert tuple(capabilities.UPROBE_PROGRAMS) == names.Main.UPROBE_PROGRAMS
