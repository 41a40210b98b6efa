"""Symbol discovery in the installed tokenizers and tiktoken wheels, and
(root) real uprobes on the found offsets counting exactly the calls made."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pyctl.symbols import tokenizers as symbols
from pyctl.tokenizer.builders import build_hf_bpe, build_tiktoken

pytest.importorskip("tokenizers", reason="needs the tokenizers wheel")
pytest.importorskip("tiktoken", reason="needs the tiktoken wheel")


@pytest.mark.parametrize("kind", sorted(symbols.KINDS))
def test_every_kind_found_in_installed_wheel(kind: str) -> None:
    path = symbols.library_of_module(symbols.KINDS[kind].library)
    eps = symbols.find_entry_points(path, kind)
    assert eps, kind
    size = path.stat().st_size
    for e in eps:
        assert e.kind == kind and e.size > 0
        assert 0 < e.file_offset < size
        assert e.mangled.startswith(("_R", "_ZN"))  # Rust, v0 or legacy
        # The demangled name has no crate hashes left.
        assert "[" not in e.demangled and "::h" not in e.demangled


def test_expected_names() -> None:
    tt = symbols.library_of_module("tiktoken")
    assert [e.demangled for e in symbols.find_entry_points(tt, "tiktoken-bpe")] == [
        "tiktoken::byte_pair_encode"
    ]
    assert [e.demangled for e in symbols.find_entry_points(tt, "tiktoken-encode")] == [
        "<tiktoken::CoreBPE>::encode"
    ]
    hf = symbols.library_of_module("tokenizers")
    (enc,) = symbols.find_entry_points(hf, "hf-encode")
    assert "TokenizerImpl<" in enc.demangled and enc.demangled.split(">>::")[1].startswith(
        "encode_char_offsets"
    )


def test_missing_symbol_error_names_patterns() -> None:
    tt = symbols.library_of_module("tiktoken")
    with pytest.raises(LookupError) as ei:
        symbols.find_entry_points(tt, "hf-bpe-merge")
    msg = str(ei.value)
    assert "merge_word" in msg and ".symtab" in msg and str(tt) in msg


def test_unknown_kind() -> None:
    with pytest.raises(KeyError, match="choose one of"):
        symbols.find_entry_points("/bin/true", "no-such-kind")


def test_stripped_library_reports_lookup_error(tmp_path: Path) -> None:
    # A real shared object without Rust encode symbols: the C library.
    libc = next(
        p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib64/libc.so.6") if os.path.exists(p)
    )
    with pytest.raises(LookupError, match="byte_pair_encode"):
        symbols.find_entry_points(libc, "tiktoken-bpe")


def test_demangle_v0_and_legacy() -> None:
    assert symbols.demangle("_ZN4core3fmt5write17h0123456789abcdefE") == "core::fmt::write"
    v0 = "_RNvCsp0gl3UJkm_8tiktoken16byte_pair_encode"
    assert symbols.demangle(v0) == "tiktoken::byte_pair_encode"
    assert symbols.demangle("plain_c_name") == "plain_c_name"
    assert symbols.demangle("_ZN3foo12Bar$LT$T$GT$3baz17h0123456789abcdefE") == "foo::Bar<T>::baz"
    # ThinLTO's suffix on promoted locals (the H200 host's tokenizers wheel):
    # the function is matched, not its clone.
    assert symbols.demangle(v0 + ".llvm.13477914035501583950") == "tiktoken::byte_pair_encode"
    assert symbols.demangle("_ZN4core3fmt5write17h0123456789abcdefE.llvm.42") == "core::fmt::write"


def test_collapse_generics() -> None:
    n = "<a::Impl<x::M, y::N<z>>>::encode::<a::In>"
    assert symbols.collapse_generics(n) == "<a::Impl<..>>::encode::<..>"
    assert symbols.collapse_generics("<A as B>::f") == "<A as B>::f"


def test_libraries_of_own_pid() -> None:
    import tiktoken._tiktoken  # noqa: F401
    import tokenizers  # noqa: F401

    libs = symbols.libraries_of_pid(os.getpid())
    assert set(libs) >= {"tokenizers", "tiktoken"}
    assert libs["tiktoken"].samefile(symbols.library_of_module("tiktoken"))
    assert symbols.resolve_library(f"pid:{os.getpid()}:tiktoken") == libs["tiktoken"]


def test_resolve_library_errors(tmp_path: Path) -> None:
    with pytest.raises(LookupError, match="no such file"):
        symbols.resolve_library(str(tmp_path / "x.so"))
    with pytest.raises(KeyError):
        symbols.resolve_library("nosuchlib")


def test_report_sentencepiece_says_hidden() -> None:
    r = symbols.report("sentencepiece")
    assert "hides its symbols" in r.note and not r.found


@pytest.mark.root
def test_uprobes_count_exactly_the_encode_calls(tracefs_mounted: str) -> None:
    from pyctl.tokenizer.uprobe_count import UprobeCounter, tracefs_ready

    why = tracefs_ready()
    if why:
        pytest.skip(why)
    tok = build_hf_bpe(300)
    enc = build_tiktoken()
    hf = symbols.library_of_module("tokenizers")
    tt = symbols.library_of_module("tiktoken")
    kinds = ["hf-encode", "hf-encode-batch", "tiktoken-encode", "tiktoken-encode-ordinary"]
    points = [
        e for k in kinds for e in symbols.find_entry_points(hf if k.startswith("hf") else tt, k)
    ]
    with UprobeCounter(points) as c:
        before = c.counts()
        for i in range(37):
            tok.encode(f"hello world {i}")
        tok.encode_batch(["a b", "c d", "e"])
        for i in range(23):
            enc.encode(f"hello world {i}")
        for _ in range(5):
            enc.encode_ordinary("zzqx")
        after = c.counts()
    got = {p.kind: after[i] - before[i] for i, p in enumerate(points)}
    # encode_char_offsets runs once per encode() and once per batch item.
    assert got == {
        "hf-encode": 37 + 3,
        "hf-encode-batch": 1,
        "tiktoken-encode": 23,
        "tiktoken-encode-ordinary": 5,
    }
    # Our probes are gone afterwards.
    assert c.group not in (Path(tracefs_mounted) / "uprobe_events").read_text()


@pytest.mark.root
def test_uprobe_counter_mounts_tracefs_itself_and_says_so() -> None:
    """In a private mount namespace with tracefs unmounted (a new machine),
    the counter mounts it, says so in one line, and counts."""
    import subprocess
    import sys

    code = (
        "from pyctl.symbols import tokenizers as symbols\n"
        "from pyctl.tokenizer.uprobe_count import UprobeCounter\n"
        "from pyctl.tokenizer.builders import build_hf_bpe\n"
        "tok = build_hf_bpe(300)\n"
        "pts = symbols.find_entry_points(symbols.library_of_module('tokenizers'), 'hf-encode')\n"
        "with UprobeCounter(pts) as c:\n"
        "    b = c.counts()\n"
        "    [tok.encode('a b') for _ in range(7)]\n"
        "    print('COUNT', c.counts()[0] - b[0])\n"
    )
    script = (
        "umount -l /sys/kernel/tracing 2>/dev/null; umount -l /sys/kernel/debug 2>/dev/null;"
        f' exec {sys.executable} -c "$0"'
    )
    r = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert r.returncode == 0, r.stderr
    assert "COUNT 7" in r.stdout
    said = [ln for ln in r.stderr.splitlines() if "mounted tracefs" in ln]
    assert len(said) == 1 and said[0].startswith("gpufault: mounted tracefs at ")
