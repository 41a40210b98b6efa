"""One name per function, decided once (pyctl/symbols/names.py): the probe
site's name (funcs, faults, trace and `calls live` summaries, metrics) and
a stack frame's name at the same address (`show`) are the same, with the
others as the site's aliases."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyctl.engine.mechanism import plan
from pyctl.spec import FaultSpec
from pyctl.symbols import names, resolve, symtab

DOUBLE = Path(__file__).resolve().parent.parent / "pyctl" / "data" / "doubles" / "libcuda.so.1"


def test_the_order() -> None:
    g, w, loc = names.BIND_RANK[1], names.BIND_RANK[2], names.BIND_RANK[0]
    assert names.canonical([("cuMemAlloc", g), ("cuMemAlloc_v2", g)]) == "cuMemAlloc_v2"
    assert names.canonical([("cuMemAllocAsync_ptsz", g), ("cuMemAllocAsync", g)]) == (
        "cuMemAllocAsync"
    )
    assert names.canonical([("cuMemcpyHtoD_v2_ptds", g), ("cuMemcpyHtoD_v2", g)]) == (
        "cuMemcpyHtoD_v2"
    )
    assert names.canonical([("__libc_malloc", g), ("malloc", g)]) == "malloc"
    assert names.canonical([("__GI___libc_write", loc), ("write", w)]) == "write"
    assert names.canonical([("glob64@GLIBC_2.2.5", g), ("glob64", g)]) == "glob64"
    assert names.canonical([("b_local", loc), ("a_weak", w)]) == "a_weak"
    assert names.canonical([("b_weak", w), ("a_local", loc)]) == "b_weak"
    # glibc's weak public name over the global one it aliases.
    assert names.canonical([("__getpid", g), ("getpid", w)]) == "getpid"
    # Not the order they are listed in.
    assert names.ranked([("x", g), ("y", g)]) == names.ranked([("y", g), ("x", g)])


def test_every_catalogued_cuda_name_is_its_sites_name() -> None:
    """The double's aliases are the catalog's: the catalog's name wins."""
    from pyctl import catalog

    lib = _double()
    _t, _l, _b, aliases = resolve._elf_symbols(lib.path)
    wrong = [
        (ranked[0], n)
        for ranked in aliases.values()
        for n in ranked[1:]
        if (info := catalog.lookup(n)) is not None and info.name == n
    ]
    assert not wrong


def _double() -> resolve.Library:
    if not DOUBLE.exists():  # pragma: no cover - make build makes it
        pytest.skip("the libcuda double is missing: run make build")
    return resolve.find_library(str(DOUBLE))


@pytest.mark.parametrize("fn", ["cuMemAlloc", "cuMemAlloc_v2", "cuMemAlloc*"])
def test_a_site_has_one_name_whichever_of_its_names_was_asked_for(fn: str) -> None:
    lib = _double()
    syms = {s.name: s for s in resolve.symbols(lib, fn)}
    assert "cuMemAlloc" not in syms  # the alias never names a site
    site = syms["cuMemAlloc_v2"]
    assert site.aliases == ["cuMemAlloc"]
    # What inject and trace probe (funcs.symbol, faults.function).
    atts = plan([FaultSpec(lib=str(DOUBLE), fn=fn)], None)
    assert "cuMemAlloc_v2" in {a.sym.name for a in atts}
    assert "cuMemAlloc" not in {a.sym.name for a in atts}


@pytest.mark.parametrize("which", ["double", "libc"])
def test_sites_and_frames_agree_on_every_address_with_several_names(which: str) -> None:
    lib = _double() if which == "double" else resolve.find_library("libc.so.6")
    table, _loads, _bid, aliases = resolve._elf_symbols(lib.path)
    assert aliases, "no address with several names: nothing checked"
    frames = symtab.load(lib.path)
    differ = []
    for addr, ranked in aliases.items():
        hit = frames.lookup(addr)
        if hit is None or hit[1] != 0:
            continue
        # A debug file may add names, never one that outranks the site's.
        if hit[0] != ranked[0] and hit[0] in ranked:
            differ.append((hex(addr), hit[0], ranked[0]))
    assert not differ
    assert len(aliases) >= (2 if which == "double" else 50)
