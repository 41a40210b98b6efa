"""Names as a person reads them, in every place they are shown and stored,
and the disk cache that makes attaching quick (issue 13).

- Demangling with known answers: `_Z3fooi`, a class template in a namespace
  (build/targets/gf_cxx), a Rust v0 name of HF tokenizers.
- pyctl/diskcache.py: root-only, atomic, keyed by build-id; symtab and
  resolve tables come back from it; a table read while a file existed
  still names frames once the path is gone (a target that died takes
  /proc/PID/root with it); capabilities' trials are kept per boot.
- Root: a target that SIGSEGVs right after its fault keeps a symbolized
  stack (command target and --pid target), the stored rows and `show`
  agree, and the fire line, faults.function and `probes` are demangled.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyctl import diskcache, elf
from pyctl.bpf import features
from pyctl.symbols import names, resolve, symtab
from pyctl.symbols.demangle import demangle

REPO = Path(__file__).resolve().parent.parent
CXX = REPO / "build" / "targets" / "gf_cxx"
GF = [sys.executable, "-m", "pyctl"]
TOK_ENCODE = "_RNvMsC_NtCs84oBVal8Hga_10tokenizers9tokenizerNtB5_11PyTokenizer6encode"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("GPUFAULT_CACHE_DIR", str(d))
    return d


def _need_cxx() -> None:
    if not CXX.exists():
        pytest.skip("build/targets/gf_cxx missing: run make build")


# ---- demangling ---------------------------------------------------------------


def test_known_answers() -> None:
    assert demangle("_Z3fooi") == "foo(int)"
    assert demangle("_ZNK4gfns3BoxIiE3getEi") == "gfns::Box<int>::get(int) const"
    assert demangle("_ZNK4gfns3BoxIiE3getEi.isra.0") == (
        "gfns::Box<int>::get(int) const [clone .isra.0]"
    )
    assert demangle(TOK_ENCODE) == "<tokenizers::tokenizer::PyTokenizer>::encode"
    assert demangle("cuMemAlloc_v2") == "cuMemAlloc_v2"
    # Idempotent: a stored (demangled) name read again stays as it is.
    assert demangle(demangle("_Z3fooi")) == "foo(int)"


def test_frames_of_the_cxx_target_are_demangled() -> None:
    _need_cxx()
    t = symtab.load(str(CXX))
    want = {"_Z3fooi": "foo(int)", "_ZNK4gfns3BoxIiE3getEi.isra.0":
            "gfns::Box<int>::get(int) const [clone .isra.0]"}  # fmt: skip
    for raw, name in want.items():
        start = t.starts[t.names.index(raw)]
        assert symtab.name_at(str(CXX), start - t.first_load + 1) == f"gf_cxx!{name}+0x1"


def test_tokenizers_rust_v0_frame() -> None:
    mod = pytest.importorskip("tokenizers.tokenizers")
    t = symtab.load(mod.__file__)
    hits = [n for n in t.names if n.startswith("_R") and demangle(n).endswith(
        "<tokenizers::tokenizer::PyTokenizer>::encode")]  # fmt: skip
    if not hits:
        pytest.skip("this tokenizers build has no PyTokenizer::encode symbol")
    start = t.starts[t.names.index(hits[0])]
    got = symtab.name_at(mod.__file__, start - t.first_load + 2)
    assert got is not None and got.endswith("!<tokenizers::tokenizer::PyTokenizer>::encode+0x2")


def test_probes_lists_demangled_names() -> None:
    _need_cxx()
    r = subprocess.run([*GF, "probes", str(CXX), "--fn", "_Z*"], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "foo(int)" in r.stdout and "gfns::Box<int>::get(int) const" in r.stdout
    assert "_Z3fooi" not in r.stdout
    j = json.loads(subprocess.run([*GF, "probes", str(CXX), "--fn", "_Z3fooi", "--json"],
                                  capture_output=True, text=True, timeout=60).stdout)  # fmt: skip
    (row,) = j["functions"]
    assert row["function"] == "_Z3fooi" and row["demangled"] == "foo(int)"


# ---- the disk cache -----------------------------------------------------------


def test_build_id_matches_pyelftools() -> None:
    from elftools.elf.elffile import ELFFile

    _need_cxx()
    with open(CXX, "rb") as f:
        (want,) = [n["n_desc"] for s in ELFFile(f).iter_sections() if s["sh_type"] == "SHT_NOTE"
                   for n in s.iter_notes() if n["n_type"] == "NT_GNU_BUILD_ID"]  # fmt: skip
    assert elf.build_id(str(CXX)) == resolve._read_elf(str(CXX))[2] == want != ""
    assert elf.build_id(str(REPO / "README.md")) == ""


def test_cache_is_root_only_atomic_and_keyed(cache: Path) -> None:
    assert diskcache.store_obj("symtab", "abc-names", {"x": 1})
    p = cache / "symtab" / f"abc-names.v{diskcache.FORMAT}"
    assert p.is_file() and p.stat().st_mode & 0o777 == 0o600
    assert (cache / "symtab").stat().st_mode & 0o777 == 0o700
    assert diskcache.load_obj("symtab", "abc-names") == {"x": 1}
    assert not [f for f in p.parent.iterdir() if f.name.startswith(".tmp-")]
    assert diskcache.load_obj("symtab", "other") is None
    # A dir others may write is not ours to trust.
    os.chmod(cache / "symtab", 0o777)
    assert diskcache.load_obj("symtab", "abc-names") is None
    os.chmod(cache / "symtab", 0o700)
    # A torn entry is no entry.
    p.write_bytes(b"\x80garbage")
    assert diskcache.load_obj("symtab", "abc-names") is None
    for bad in ("", "../x", ".hidden"):
        assert not diskcache.store_obj("symtab", bad, 1)


def test_cache_off_and_unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFAULT_CACHE_DIR", "")
    assert not diskcache.store_obj("symtab", "k", 1) and diskcache.load_obj("symtab", "k") is None
    ro = tmp_path / "ro"
    ro.write_text("a file, not a dir")
    monkeypatch.setenv("GPUFAULT_CACHE_DIR", str(ro))
    assert not diskcache.store_obj("symtab", "k", 1)  # no cache, no error


def _copy(src: Path, dst: Path) -> str:
    shutil.copy2(src, dst)
    return str(dst)


def test_tables_come_back_from_disk_keyed_by_build_id(cache: Path, tmp_path: Path) -> None:
    _need_cxx()
    a = _copy(CXX, tmp_path / "a")
    first = symtab.load(a)
    bid = first.build_id
    assert (cache / "symtab" / f"{bid}-names-{names.CACHE_TAG}.v{diskcache.FORMAT}").is_file()
    resolve._elf_symbols(a)
    assert (cache / "symtab" / f"{bid}-sites-{names.CACHE_TAG}.v{diskcache.FORMAT}").is_file()
    # The same build at another path (a new inode: not in memory) is one
    # entry, read without parsing.
    b = _copy(CXX, tmp_path / "b")
    t = symtab._from_disk(b, "", elf.build_id(b))
    assert t is not None and t.path == b and t.names == first.names
    assert resolve._cached_read_elf(b) == resolve._read_elf(b)
    # Another build-id: another key, never this entry.
    (cache / "symtab" / f"{bid}-names-{names.CACHE_TAG}.v{diskcache.FORMAT}").unlink()
    assert symtab._from_disk(b, "", elf.build_id(b)) is None


def test_a_new_debug_file_invalidates_the_cached_table(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_cxx()
    a = _copy(CXX, tmp_path / "a")
    monkeypatch.setattr(symtab, "DEBUG_ROOT", str(tmp_path / "debug"))
    t = symtab.load(a)
    assert symtab._from_disk(a, "", elf.build_id(a)) is not None
    dbg = tmp_path / "debug" / ".build-id" / t.build_id[:2] / f"{t.build_id[2:]}.debug"
    dbg.parent.mkdir(parents=True)
    shutil.copy2(CXX, dbg)  # libc6-dbg installed since: its names must be read
    assert symtab._from_disk(a, "", elf.build_id(a)) is None


def test_a_table_read_while_the_file_lived_still_names_frames(tmp_path: Path) -> None:
    _need_cxx()
    a = _copy(CXX, tmp_path / "gf_cxx")
    t = symtab.load(a)
    rel = t.starts[t.names.index("_Z3fooi")] - t.first_load
    os.unlink(a)  # as /proc/PID/root/... is once the process is gone
    assert symtab.is_loaded(a)
    assert symtab.name_at(a, rel) == "gf_cxx!foo(int)+0x0"
    from pyctl.symbols.symbolize import name_in

    assert name_in(a, rel, parse=False) == "gf_cxx!foo(int)+0x0"


def test_capability_trials_are_kept_per_boot(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def trial() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(features.os, "geteuid", lambda: 0)
    assert features.boot_cached("t", trial) is True
    if not diskcache.boot_key() or os.getuid() != 0:
        pytest.skip("no boot id here, or the cache dir is not root's")
    assert features.boot_cached("t", trial) is True
    assert len(calls) == 1
    (entry,) = (cache / "caps").iterdir()
    assert entry.name.startswith(diskcache.boot_key())
    # Another boot (or kernel) is another entry: tried again.
    monkeypatch.setattr(diskcache, "boot_key", lambda: "other-boot-6.1")
    assert features.boot_cached("t", trial) is True
    assert len(calls) == 2


# ---- root: a target that dies right after its fault ------------------------------


def _stacks(db: Path, fid: str) -> list[tuple[int, str, str | None]]:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT depth, symbol, module FROM stacks WHERE fault_id=? "
                         "ORDER BY depth", (fid,)).fetchall()  # fmt: skip


def _show(db: Path, fid: str) -> dict:
    r = subprocess.run([*GF, "show", fid, "--json", "--db", str(db)], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _agree(db: Path, fid: str) -> list[str]:
    stored = _stacks(db, fid)
    shown = [s["symbol"] for s in _show(db, fid)["stack"]]
    assert [s for _d, s, _m in stored] == shown  # the database says what show says
    return shown


@pytest.mark.root
def test_cxx_command_that_segfaults_at_its_fault(tmp_path: Path) -> None:
    _need_cxx()
    db = tmp_path / "gf.db"
    r = subprocess.run(
        [*GF, "inject", "--lib", str(CXX), "--fn", "_Z3fooi", "--action", "signal",
         "--signal", "SIGSEGV", "--db", str(db), "--", str(CXX), "5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 128 + signal.SIGSEGV, r.stderr
    assert "foo(int)" in r.stderr and "_Z3fooi" not in r.stderr.split("probes:", 1)[-1]
    (fire,) = [ln for ln in r.stderr.splitlines() if ln.startswith("FAULT")]
    assert "  foo(int)  " in fire
    with sqlite3.connect(db) as c:
        ((fid, function),) = c.execute("SELECT fault_id, function FROM faults").fetchall()
        (raw,) = c.execute("SELECT symbol FROM funcs").fetchone()
    assert function == "foo(int)" and raw == "_Z3fooi"
    shown = _agree(db, fid)
    assert shown[0].startswith("gf_cxx!foo(int)+0x"), shown
    assert shown[1].startswith("gf_cxx!main+0x"), shown  # the caller, from [sp]
    assert _show(db, fid)["fault"]["function"] == "foo(int)"


@pytest.mark.root
def test_pid_target_that_dies_keeps_its_stack(tmp_path: Path) -> None:
    """--pid: the library is opened through /proc/PID/root, which is gone
    when the fire is read; what was read at attach still names the frames."""
    from gftarget import LIB, Target

    t = Target()
    db = tmp_path / "gf.db"
    gf = subprocess.Popen(
        [*GF, "inject", "--pid", str(t.pid), "--lib", str(LIB), "--fn", "gf_alloc",
         "--action", "signal", "--signal", "SIGSEGV", "--duration", "30s", "--db", str(db)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert gf.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = gf.stderr.readline()
            assert line, "gpufault ended before its probes were live"
            if "Ctrl-C to end" in line:
                break
        with pytest.raises(EOFError):
            t.cmd("alloc 3")
        assert t.p.wait(10) == -signal.SIGSEGV
        gf.wait(60)
    finally:
        if gf.poll() is None:
            gf.terminate()
            gf.wait(30)
        t.close()
    with sqlite3.connect(db) as c:
        (fid,) = c.execute("SELECT fault_id FROM faults").fetchone()
    shown = _agree(db, fid)
    assert shown[0].startswith("libgftarget.so!gf_alloc+0x"), shown
    assert all(not s.startswith("0x") for s in shown), shown
    assert all(m for _d, _s, m in _stacks(db, fid)), "every frame keeps its module"


def test_fast_commands_are_the_registered_ones() -> None:
    from pyctl.cli import FAST_COMMANDS, _only_run_command
    from pyctl.cli.commands import COMMANDS

    assert set(FAST_COMMANDS.values()) <= set(COMMANDS)
    for argv in (["trace", "--help"], ["--db", "x.db", "inject"], ["--debug", "--db=x", "trace"]):
        assert _only_run_command(argv) is not None, argv
    for argv in ([], ["show", "x"], ["--db", "trace"], ["--version"]):
        assert _only_run_command(argv) is None, argv
