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


CUDA_CHILD = """
import ctypes, sys
cu = ctypes.CDLL(sys.argv[1])
p = ctypes.c_uint64()
print("ready", flush=True)
for line in sys.stdin:
    for _ in range(int(line)):
        cu.cuMemAlloc_v2(ctypes.byref(p), 16)
    print("done", flush=True)
"""


@pytest.mark.root
def test_every_reader_says_the_one_name(tmp_path: Path) -> None:
    """Asked for by its alias, a fault on the double's cuMemAlloc_v2 is
    cuMemAlloc_v2 in funcs, faults, the trace summary, the metrics label,
    show (with the alias noted) and the stack frame it fired in."""
    import subprocess
    import sys

    from pyctl.calls import summary
    from pyctl.engine import Engine
    from pyctl.evidence import query, store
    from pyctl.observe.metrics import Metrics

    _double()
    p = subprocess.Popen(
        [sys.executable, "-c", CUDA_CHILD, str(DOUBLE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdin and p.stdout and p.stdout.readline().strip() == "ready"
    db = tmp_path / "gf.db"
    s = FaultSpec(
        lib=str(DOUBLE), fn="cuMemAlloc", action="fail", ret=2, nth=2, trace=True, tgid=p.pid
    )
    eng = Engine([s], db_path=db, pid=p.pid, argv=["test"])
    with Metrics.start("127.0.0.1:0") as m:
        eng.on_fire = m.on_fire
        eng.start()
        try:
            p.stdin.write("3\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "done"
            eng.drain()
        finally:
            eng.close()
            p.stdin.close()
            p.wait(timeout=10)
        labels = {"function": "cuMemAlloc_v2", "code": "CUDA_ERROR_OUT_OF_MEMORY"}
        assert (
            m.registry.get_sample_value(
                "gpufault_faults_fired_total", {**labels, "experiment": "", "slo_id": "", "run": ""}
            )
            == 1.0
        )
    d = store.open_db(db, readonly=True)
    try:
        assert d.conn.execute("SELECT symbol, aliases FROM funcs").fetchall() == [
            ("cuMemAlloc_v2", '["cuMemAlloc"]')
        ]
        assert d.conn.execute("SELECT function FROM faults").fetchall() == [("cuMemAlloc_v2",)]
        (f,) = summary.from_calls(d, "last").functions
        assert (f.function, f.aliases, f.calls) == ("cuMemAlloc_v2", ["cuMemAlloc"], 3)
        doc = query.fault_chain(d, query.latest_fault(d))
        assert doc is not None
        text = query.render_chain(doc)
        assert "  call      cuMemAlloc_v2 (alias cuMemAlloc) #2 in " in text
        assert "!cuMemAlloc_v2+0x" in doc["stack"][0]["symbol"]
        assert "!cuMemAlloc+" not in text
    finally:
        d.close()
