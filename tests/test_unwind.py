"""Stacks without frame pointers, and frames of a target that died (issue 22).

- pyctl/symbols/cfi.py against pyelftools (the oracle: its full parse of
  libc's .eh_frame takes seconds, ours one FDE at a time): the CFA rule
  and the saved-register rules agree row by row.
- pyctl/symbols/unwind.py stops cleanly: a return address outside every
  executable mapping, or a copy that ends, ends the walk with a reason and
  never becomes a frame.
- Root: C and C++ targets built -O2 -fomit-frame-pointer, and HF
  tokenizers' Rust wheel called from Python, unwound by gpufault from the
  stack copy at the fire, equal perf record --call-graph dwarf's frames on
  the same binary and function, frame by frame (function names and
  modules).
- Root: a C++ command killed by an injected SIGABRT right at its fault
  keeps start_thread and every frame's module and build-id (the mappings
  come from perf mmap records followed from attach on, not from
  /proc/PID/maps after the fact).
"""

from __future__ import annotations

import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from pyctl.symbols import cfi, maps, unwind
from pyctl.symbols.mapwatch import MapWatch

REPO = Path(__file__).resolve().parent.parent
NOFP = REPO / "build" / "targets" / "gf_nofp"
NOFP_CC = REPO / "build" / "targets" / "gf_nofp_cc"
LIBC = "/lib/x86_64-linux-gnu/libc.so.6"
GF = [sys.executable, "-m", "pyctl"]
LEAF = {NOFP: "gf_nofp_leaf", NOFP_CC: "_ZN6gfnofp4leafEl"}


def _need(p: Path) -> None:
    if not p.exists():
        pytest.skip(f"{p.relative_to(REPO)} missing: run make build")


# ---- the CFI decoder, against pyelftools ---------------------------------------


@pytest.mark.parametrize("path", [LIBC, str(NOFP_CC)])
def test_cfi_rows_equal_pyelftools(path: str) -> None:
    elffile = pytest.importorskip("elftools.elf.elffile")
    if not Path(path).exists():
        pytest.skip(f"{path} missing")
    fc = unwind.load(path)
    assert fc is not None and len(fc.table) > 0
    with open(path, "rb") as fh:
        dw = elffile.ELFFile(fh).get_dwarf_info(follow_links=False)
        fdes = [e for e in dw.EH_CFI_entries() if "initial_location" in getattr(e, "header", {})]
        random.seed(22)
        checked = 0
        for fde in random.sample(fdes, min(80, len(fdes))):
            table = fde.get_decoded().table
            end = fde.header.initial_location + fde.header.address_range
            for i, row in enumerate(table):
                last = table[i + 1]["pc"] - 1 if i + 1 < len(table) else end - 1
                for pc in (row["pc"], last):
                    mine = fc.table.row(pc)
                    assert mine is not None, hex(pc)
                    want = row["cfa"]
                    if want.expr is not None:
                        assert mine.cfa_expr is not None, hex(pc)
                    else:
                        assert (mine.cfa_reg, mine.cfa_off) == (want.reg, want.offset), hex(pc)
                    for reg in (*unwind.CALLEE_SAVED, cfi.RA):
                        r = row.get(reg)
                        if r is not None and r.type == "OFFSET":
                            assert mine.regs.get(reg) == ("off", r.arg), (hex(pc), reg)
                    checked += 1
    assert checked > min(100, 4 * len(fdes))


def _maps_of(path: Path, lo: int) -> maps.Maps:
    size = path.stat().st_size
    return maps.Maps([maps.Mapping(lo, lo + ((size + 4095) & ~4095), 0, "r-xp", str(path))])


def test_walk_stops_at_an_address_outside_every_mapping() -> None:
    """rsp holds a word of ASCII where the return address should be: the
    walk says so and shows only the probed frame."""
    _need(NOFP)
    from pyctl import elf

    with elf.ElfFile.open(str(NOFP)) as f:
        (leaf,) = [s for s in f.symbols(".symtab") if s.name == "gf_nofp_leaf"]
    lo = 0x555555554000
    sp = 0x7FFF0000F000
    garbage = int.from_bytes(b" step \0\0", "little")  # 0x0000207065747320
    stack = unwind.Stack(sp, garbage.to_bytes(8, "little") + bytes(56))
    regs = {"ip": lo + leaf.value, "sp": sp, "bp": 0x4141414141414141}
    walk = unwind.unwind(regs, stack, _maps_of(NOFP, lo))
    assert [f.method for f in walk.frames] == ["ip"]
    assert walk.frames[0].offset == leaf.value
    assert "no executable mapping" in walk.stop and f"{garbage:#x}" in walk.stop


def test_walk_stops_at_the_end_of_the_copy() -> None:
    _need(NOFP)
    from pyctl import elf

    with elf.ElfFile.open(str(NOFP)) as f:
        (leaf,) = [s for s in f.symbols(".symtab") if s.name == "gf_nofp_leaf"]
    lo, sp = 0x555555554000, 0x7FFF0000F000
    walk = unwind.unwind({"ip": lo + leaf.value, "sp": sp}, unwind.Stack(sp, b""),
                         _maps_of(NOFP, lo))  # fmt: skip
    assert len(walk.frames) == 1 and "outside the copied stack" in walk.stop


def test_plt_cfa_expression() -> None:
    """The .plt's CFA is a DWARF expression: rsp + 8, plus 8 past the push."""
    regs = {cfi.RSP: 0x1000, cfi.RA: 0x40100B}
    code = bytes([0x77, 8, 0x80, 0, 0x3F, 0x1A, 0x3B, 0x2A, 0x33, 0x24, 0x22])
    assert unwind._expr(code, regs, unwind.Stack(0, b""), None) == 0x1010
    regs[cfi.RA] = 0x401006
    assert unwind._expr(code, regs, unwind.Stack(0, b""), None) == 0x1008


# ---- root: gpufault's frames against perf's --------------------------------------


def _inject_abort(db: Path, target: Path, n: int = 2, *, lib: Path | None = None,
                  fn: str = "", cmd: list[str] | None = None) -> tuple[int, str]:  # fmt: skip
    cmd = cmd or [str(target), str(n)]
    r = subprocess.run(
        [*GF, "inject", "--lib", str(lib or target), "--fn", fn or LEAF[target], "--action",
         "signal", "--signal", "SIGABRT", "--nth", "1", "--db", str(db), "--", *cmd],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    with sqlite3.connect(db) as c:
        (fid,) = c.execute("SELECT fault_id FROM faults").fetchone()
    return r.returncode, fid


def _rows(db: Path, fid: str) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return c.execute(
            "SELECT depth, address, symbol, module, offset, build_id, method, stop FROM stacks "
            "WHERE fault_id=? ORDER BY depth", (fid,)).fetchall()  # fmt: skip


def _bare(name: str) -> str:
    """A function name as perf prints it: no parameter list, no const."""
    name = re.sub(r"\+0x[0-9a-f]+$", "", name)
    if name.endswith(" const"):
        name = name[: -len(" const")]
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                return name[:i]
    return name


def _chain(db: Path, fid: str) -> dict:
    """What `show` reads (pyctl/evidence/query.py): names a frame left as
    lib+0xoff at ingest (a big library: libpython) from module and offset."""
    from pyctl.evidence import query, store

    conn = store.open_db(db, readonly=True)
    try:
        doc = query.fault_chain(conn, fid)
    finally:
        conn.close()
    assert doc is not None
    return doc


def _ours(db: Path, fid: str) -> list[tuple[str, str]]:
    out = []
    for s in _chain(db, fid)["stack"]:
        sym = s["symbol"]
        name = sym.split("!", 1)[1] if "!" in sym else "[unknown]"
        out.append((_bare(name), Path(s["module"]).name))
    return out


def _perf(tmp: Path, lib: Path, symbol: str, cmd: list[str]) -> list[tuple[str, str]]:
    """perf's frames for the first hit of the same function (a uprobe via
    perf probe, --call-graph dwarf with a 16 KiB copy, as ours); inlined
    frames (perf reads DWARF line info) are left out: a return address
    names the function it is in."""
    if shutil.which("perf") is None:
        pytest.skip("perf missing: tools/setup-deps.sh installs linux-perf")
    group = "gf_unwind_test"
    subprocess.run(["perf", "probe", "-q", "-d", f"{group}:*"], capture_output=True)
    from pyctl import elf

    with elf.ElfFile.open(str(lib)) as f:
        (sym,) = [s for s in f.symbols(".symtab") if s.name == symbol]
        at = f.vaddr_to_offset(sym.value)  # perf probe -x ADDR takes a file offset
    assert at is not None
    add = ["perf", "probe", "-x", str(lib), "-a", f"{group}:leaf={at:#x}"]
    r = subprocess.run(add, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"perf probe cannot add a uprobe here: {r.stderr.strip()[-200:]}")
    data = tmp / "perf.data"
    try:
        subprocess.run(["perf", "record", "-q", "-o", str(data), "-e", f"{group}:leaf",
                        "--call-graph", "dwarf,16384", "--", *cmd],
                       capture_output=True, check=True, timeout=120)  # fmt: skip
        out = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip,sym,dso"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    finally:
        subprocess.run(["perf", "probe", "-q", "-d", f"{group}:*"], capture_output=True)
    first = out.strip().split("\n\n")[0]
    frames = []
    for line in first.splitlines():
        m = re.match(r"\s*[0-9a-f]+ (.*) \((.*)\)$", line)
        assert m, line
        if m.group(2) != "inlined":
            frames.append((m.group(1), Path(m.group(2)).name))
    return frames


@pytest.mark.root
@pytest.mark.usefixtures("tracefs_mounted")  # perf probe mounts it and leaves it
@pytest.mark.parametrize("target", [NOFP, NOFP_CC], ids=["c", "cxx"])
def test_unwound_frames_equal_perfs(tmp_path: Path, target: Path) -> None:
    _need(target)
    want = _perf(tmp_path, target, LEAF[target], [str(target), "2"])
    rc, fid = _inject_abort(tmp_path / "gf.db", target)
    assert rc == 128 + signal.SIGABRT
    got = _ours(tmp_path / "gf.db", fid)
    assert got == want, f"\ngpufault: {got}\nperf:     {want}"
    rows = _rows(tmp_path / "gf.db", fid)
    assert [r[6] for r in rows] == ["ip"] + ["cfi"] * (len(rows) - 1)
    assert rows[-1][7] == "return address undefined: the outermost frame"


@pytest.mark.root
def test_cxx_killed_by_sigabrt_keeps_every_module(tmp_path: Path) -> None:
    """The process is gone ~0.2 ms after its fault, long before its fire
    is read; its libc and libstdc++ frames still have module, build-id and
    offset, and `show` says the same, with each frame's method."""
    _need(NOFP_CC)
    db = tmp_path / "gf.db"
    rc, fid = _inject_abort(db, NOFP_CC)
    assert rc == 128 + signal.SIGABRT
    rows = _rows(db, fid)
    syms = [r[2] for r in rows]
    assert any(s.startswith("libc.so.6!start_thread+0x") for s in syms), syms
    assert all(r[3] and r[4] is not None and r[5] for r in rows), rows
    assert {Path(r[3]).name for r in rows} >= {"gf_nofp_cc", "libc.so.6"}
    assert any(Path(r[3]).name.startswith("libstdc++.so.6") for r in rows)
    assert not any(s.startswith("0x") for s in syms)
    # What `show` prints (pyctl/evidence/query.py), read as it reads it.
    from pyctl.evidence import query

    shown = _chain(db, fid)
    assert [s["symbol"] for s in shown["stack"]] == syms
    assert [s["method"] for s in shown["stack"]] == [r[6] for r in rows]
    assert shown["stack_stop"] == rows[-1][7]
    text = query.render_chain(shown)
    assert "[cfi]" in text and "(ends: return address undefined" in text


@pytest.mark.root
def test_mapwatch_sees_an_exec_after_attach() -> None:
    """Attached to a held shell that then execs: the new image's libraries
    are known after the process has exited, with no /proc read."""
    _need(NOFP_CC)
    import os

    r, w = os.pipe()
    p = subprocess.Popen(["/bin/sh", "-c", f'read -r _ < /proc/self/fd/{r}; exec "$@"', "hold",
                          str(NOFP_CC), "1"], pass_fds=(r,), stdout=subprocess.DEVNULL)  # fmt: skip
    os.close(r)
    try:
        mw = MapWatch(p.pid)
        os.write(w, b"go\n")
    finally:
        os.close(w)
        p.wait(30)
    try:
        assert not Path(f"/proc/{p.pid}").exists()
        names = {Path(m.path).name for m in mw.maps().maps if m.executable}
        assert "gf_nofp_cc" in names and "libc.so.6" in names, names
        assert "dash" not in names and "sh" not in names  # the exec started the list over
    finally:
        mw.close()


@pytest.mark.root
@pytest.mark.usefixtures("tracefs_mounted")  # perf probe mounts it and leaves it
def test_rust_wheel_frames_equal_perfs(tmp_path: Path) -> None:
    """HF tokenizers' Rust extension (no frame pointers) called from
    Python: the Rust frames, pyo3's trampolines, libpython's C frames and
    libc's, as perf unwinds them, frame by frame."""
    mod = pytest.importorskip("tokenizers.tokenizers")
    from pyctl.symbols import tokenizers as tok_symbols

    lib = Path(mod.__file__)
    (entry,) = tok_symbols.find_entry_points(str(lib), "hf-encode")
    cmd = [sys.executable, str(REPO / "tests" / "targets" / "tok_encode.py"), "2"]
    want = _perf(tmp_path, lib, entry.mangled, cmd)
    rc, fid = _inject_abort(tmp_path / "gf.db", lib, lib=lib, fn=entry.mangled, cmd=cmd)
    assert rc == 128 + signal.SIGABRT
    got = _ours(tmp_path / "gf.db", fid)
    # The two demanglers spell a Rust closure differently ({closure:#0},
    # {closure#0}): the same frame.
    got = [(n.replace("{closure:#", "{closure#"), m) for n, m in got]
    # Frame by frame through the Rust, pyo3 and interpreter frames, down to
    # the first libc frame. Below it perf (6.1) goes from
    # __libc_start_call_main straight to _start; libc's CFI puts
    # __libc_start_main (its return address after the call) in between,
    # which we show: perf's frames there are ours less that one.
    k = next(i for i, f in enumerate(want) if f[1] == "libc.so.6")
    assert k >= 10 and got[: k + 1] == want[: k + 1], f"\ngpufault: {got}\nperf:     {want}"
    rest = iter(got[k + 1 :])
    assert all(f in rest for f in want[k + 1 :]), f"\ngpufault: {got}\nperf:     {want}"
    assert got[0][0].endswith("encode_char_offsets::<tokenizers::tokenizer::EncodeInput>")


# ---- a library whose segments leave a hole (libcuda's layout) ------------------

# norelro + noseparate-code + 2 MiB pages: the data segment's file offset
# is right after the text (0x5xx) and its vaddr 2 MiB on; 3 MiB of data
# make its file range cover the page where the loader's no-access hole
# between the two starts. /proc/PID/maps shows that hole ("---p") at the
# data segment's first page offset: the layout that had libcuda's frames
# named 0x200000 past their function on the H200 (docs/gpu-validation.md
# run 33).
GAP_LIB = "char big[3 << 20] = {1};\nint gap_fn(int x) { return x * 3 + big[x & 1]; }\n"
GAP_MAIN = r"""
#include <stdio.h>
#include <unistd.h>
int gap_fn(int);
int main(void) {
	int s = 0;
	puts("ready");
	fflush(stdout);
	for (;;) {
		s += gap_fn(s);
		usleep(1000);
	}
}
"""


def _gap_build(tmp: Path) -> tuple[Path, Path]:
    if shutil.which("gcc") is None:
        pytest.skip("gcc missing")
    (tmp / "gap.c").write_text(GAP_LIB)
    (tmp / "main.c").write_text(GAP_MAIN)
    lib, exe = tmp / "libgfgap.so", tmp / "gfgap"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wl,-z,noseparate-code", "-Wl,-z,norelro",
                    "-Wl,-z,max-page-size=0x200000", "-o", str(lib), str(tmp / "gap.c")],
                   check=True)  # fmt: skip
    subprocess.run(["gcc", "-O2", "-o", str(exe), str(tmp / "main.c"), str(lib),
                    f"-Wl,-rpath,{tmp}"], check=True)  # fmt: skip
    return lib, exe


def _gap_fn_range(lib: Path) -> tuple[int, int]:
    from pyctl import elf

    with elf.ElfFile.open(str(lib)) as f:
        (sym,) = [s for s in f.symbols(".symtab") if s.name == "gap_fn"]
        return sym.value, sym.value + sym.size


def test_a_segment_hole_does_not_move_the_load_base(tmp_path: Path) -> None:
    """The maps read at attach (a library mapped before gpufault came):
    the hole's mapping gives the base the r-xp mapping at offset 0 gives,
    in both readers (the unwinder's Maps and the symbolizer's file maps)."""
    lib, exe = _gap_build(tmp_path)
    p = subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        with open(f"/proc/{p.pid}/maps") as f:
            mine = [ln.split() for ln in f if ln.rstrip().endswith(str(lib))]
        text = [int(m[0].split("-")[0], 16) for m in mine if m[1] == "r-xp" and int(m[2], 16) == 0]
        holes = [m for m in mine if m[1] == "---p"]
        assert text and holes, mine  # the layout this test is about
        mw = MapWatch(p.pid)
        try:
            assert mw.maps().load_base(str(lib)) == text[0]
            fm = [(lo, off) for lo, _hi, off, path in mw.file_maps() if path == str(lib)]
            assert {lo - off for lo, off in fm} == {text[0]}, [(hex(a), hex(b)) for a, b in fm]
        finally:
            mw.close()
    finally:
        p.kill()
        p.wait()


@pytest.mark.root
def test_a_segment_hole_library_attached_by_pid_names_its_function(tmp_path: Path) -> None:
    """Attached by --pid to a process that mapped the library long before:
    frame #0 is gap_fn at an offset inside gap_fn's symbol, frame #1 main."""
    lib, exe = _gap_build(tmp_path)
    lo, hi = _gap_fn_range(lib)
    db = tmp_path / "gf.db"
    p = subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        r = subprocess.run([*GF, "inject", "--pid", str(p.pid), "--lib", str(lib), "--fn", "gap_fn",
                            "--action", "signal", "--signal", "SIGABRT", "--nth", "1",
                            "--duration", "30s", "--db", str(db)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert p.wait(30) == -signal.SIGABRT, r.stderr
    finally:
        p.kill()
        p.wait()
    with sqlite3.connect(db) as c:
        (fid,) = c.execute("SELECT fault_id FROM faults").fetchone()
    rows = _rows(db, fid)
    assert rows[0][3] == str(lib) and lo <= rows[0][4] < hi, (rows[0], hex(lo), hex(hi))
    assert rows[0][2].split("!")[-1].startswith("gap_fn"), rows[0]
    assert rows[1][3] == str(exe) and "main" in rows[1][2], rows[1]


# ---- CFI kept outside the binary: a debug file, MiniDebugInfo -------------------

DF_SRC = r"""
#include <stdio.h>
#include <stdlib.h>
#define KEEP __asm__ volatile("" ::: "memory")
__attribute__((noinline)) long df_leaf(long x) { KEEP; return x * 7 + 1; }
__attribute__((noinline)) long df_mid(long x) { long r = df_leaf(x + 1); KEEP; return r + 3; }
int main(int argc, char **argv) {
	long n = argc > 1 ? atol(argv[1]) : 1, s = 0;
	for (long i = 0; i < n; i++)
		s += df_mid(i);
	printf("%ld\n", s);
	return 0;
}
"""
DF_CHAIN = ["df_leaf", "df_mid", "main", "__libc_start_call_main", "__libc_start_main", "_start"]


def _df_build(tmp: Path, where: str) -> Path:
    """A program built without unwind tables (its CFI only in .debug_frame)
    and no frame pointers, then stripped; its .debug_frame kept in a
    debug file beside it (debuglink), in its .gnu_debugdata, or nowhere."""
    for tool in ("gcc", "objcopy", "strip"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} missing")
    (tmp / "df.c").write_text(DF_SRC)
    full, exe = tmp / "df.full", tmp / "df"
    subprocess.run(["gcc", "-O2", "-g", "-fomit-frame-pointer", "-fno-asynchronous-unwind-tables",
                    "-fno-unwind-tables", "-rdynamic", "-o", str(full), str(tmp / "df.c")],
                   check=True)  # fmt: skip
    subprocess.run(["strip", "--strip-all", "-o", str(exe), str(full)], check=True)
    if where == "debuglink":
        dbg = tmp / "df.debug"
        subprocess.run(["objcopy", "--only-keep-debug", str(full), str(dbg)], check=True)
        subprocess.run(["objcopy", f"--add-gnu-debuglink={dbg}", str(exe)], check=True, cwd=tmp)
    elif where == "gnu_debugdata":
        import lzma

        mini = tmp / "mini"
        drop = [f"--remove-section=.debug_{s}" for s in ("info", "line", "str", "abbrev")]
        subprocess.run(["objcopy", "--only-keep-debug", *drop, str(full), str(mini)], check=True)
        (tmp / "mini.xz").write_bytes(lzma.compress(mini.read_bytes()))
        subprocess.run(["objcopy", f"--add-section=.gnu_debugdata={tmp / 'mini.xz'}", str(exe)],
                       check=True)  # fmt: skip
    from pyctl import elf

    with elf.ElfFile.open(str(exe)) as f:
        assert ".debug_frame" not in f.frame_sections()  # only elsewhere, if at all
    return exe


@pytest.mark.root
@pytest.mark.parametrize("where", ["debuglink", "gnu_debugdata", "nowhere"])
def test_cfi_from_a_debug_file_or_minidebuginfo(tmp_path: Path, where: str) -> None:
    """A stripped program whose only CFI is .debug_frame, kept in its debug
    file or its MiniDebugInfo: unwound through every frame to _start; with
    it nowhere, the walk stops at the first frame and says why."""
    exe = _df_build(tmp_path, where)
    db = tmp_path / "gf.db"
    r = subprocess.run([*GF, "inject", "--lib", str(exe), "--fn", "df_leaf", "--action", "signal",
                        "--signal", "SIGABRT", "--nth", "1", "--db", str(db), "--", str(exe), "3"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 128 + signal.SIGABRT, r.stderr
    with sqlite3.connect(db) as c:
        (fid,) = c.execute("SELECT fault_id FROM faults").fetchone()
    rows = _rows(db, fid)
    names = [re.sub(r"\+0x[0-9a-f]+$", "", row[2].split("!")[-1]) for row in rows]
    if where == "nowhere":
        assert names == ["df_leaf"] and rows[0][7].startswith("no CFI covers"), rows
    else:
        assert names == DF_CHAIN, rows
        assert [row[6] for row in rows] == ["ip"] + ["cfi"] * (len(rows) - 1)


@pytest.mark.root
@pytest.mark.parametrize("copy", ["0", "32K"])
def test_stack_copy_size_is_the_runs_choice(tmp_path: Path, copy: str) -> None:
    """--stack-copy 0: frame pointers only (no frame found by CFI, and the
    -O2 target has none, so the walk ends at the caller); 32K: the largest
    copy unwinds as the default does."""
    _need(NOFP)
    db = tmp_path / "gf.db"
    r = subprocess.run([*GF, "inject", "--lib", str(NOFP), "--fn", LEAF[NOFP], "--action",
                        "signal", "--signal", "SIGABRT", "--nth", "1", "--stack-copy", copy,
                        "--db", str(db), "--", str(NOFP), "2"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 128 + signal.SIGABRT, r.stderr
    with sqlite3.connect(db) as c:
        (fid,) = c.execute("SELECT fault_id FROM faults").fetchone()
    methods = [row[6] for row in _rows(db, fid)]
    if copy == "0":
        assert "cfi" not in methods, methods
    else:
        assert methods[0] == "ip" and methods[1:] and set(methods[1:]) == {"cfi"}, methods


@pytest.mark.parametrize("bad", ["64K", "-1", "lots"])
def test_a_bad_stack_copy_is_one_line(bad: str) -> None:
    r = subprocess.run([*GF, "inject", "--lib", "libc", "--fn", "read", "--action", "observe",
                        f"--stack-copy={bad}", "--", "true"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--stack-copy" in r.stderr, r.stderr
