"""Find the native encode entry points of tokenizer libraries.

The Rust wheels (Hugging Face `tokenizers`, `tiktoken`) ship a full
`.symtab` (checked on tokenizers 0.23.3 and tiktoken 0.14.0: 26k and 9k
symbols, Rust v0 mangling). We read it (pyctl/elf.py), demangle the Rust
names (v0 `_R...` and legacy `_ZN...17h<hash>E`) and match the demangled,
hash-free form against version-tolerant patterns per `kind`.

Demangling 26k names costs about 2 s in pure Python, so a symbol is only
demangled when its mangled form contains the length-prefixed identifier a
pattern needs (`6encode`, `16byte_pair_encode`): both manglings spell
identifiers that way, so the prefilter loses nothing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from pyctl import elf

# x86-64 `endbr64`: a uprobe on it is single-stepped out of line (about
# 40x slower than an emulated first instruction, see DESIGN.md), so we say so.
ENDBR64 = bytes.fromhex("f30f1efa")


class EntryPoint(NamedTuple):
    """One probe-able function. `address` is st_value (the link-time
    virtual address); `file_offset` is what a uprobe on the file needs."""

    mangled: str
    demangled: str
    address: int
    size: int
    file_offset: int
    library: str
    kind: str
    first_bytes: str  # hex of the first 8 bytes, to spot slow probe sites

    @property
    def starts_with_endbr64(self) -> bool:
        return bytes.fromhex(self.first_bytes).startswith(ENDBR64)


@dataclass(frozen=True)
class KindSpec:
    """What a kind means: the identifiers a name must contain (prefilter)
    and regexes on the normalised demangled name (any may match; patterns
    cover older layouts of the same function)."""

    library: str  # 'tokenizers' or 'tiktoken'
    idents: tuple[str, ...]
    patterns: tuple[str, ...]
    what: str


# Patterns are matched against the demangled name with crate hashes and
# legacy `::h<16 hex>` suffixes removed and `{closure:#0}` spelled `{closure#0}`.
_TOK = r"<?tokenizers::tokenizer::(?:TokenizerImpl|Tokenizer)<.*>>?"
KINDS: dict[str, KindSpec] = {
    "hf-encode": KindSpec(
        "tokenizers",
        ("encode_char_offsets", "encode"),
        (
            # 0.13+: PyTokenizer.encode -> TokenizerImpl::encode_char_offsets
            _TOK + r"::encode_char_offsets(::<.*>)?",
            # older layouts (<= 0.12) called TokenizerImpl::encode directly
            _TOK + r"::encode(::<.*>)?",
        ),
        "one call per Tokenizer.encode() and per item of encode_batch()",
    ),
    "hf-encode-batch": KindSpec(
        "tokenizers",
        ("encode_batch_char_offsets", "encode_batch"),
        (
            _TOK + r"::encode_batch_char_offsets(::<.*>)?",
            _TOK + r"::encode_batch(::<.*>)?",
        ),
        "one call per Tokenizer.encode_batch()",
    ),
    "hf-encode-sequence": KindSpec(
        "tokenizers",
        ("encode_single_sequence",),
        (_TOK + r"::encode_single_sequence(::<.*>)?",),
        "one call per sequence (a pair is two), also inside encode_batch",
    ),
    "hf-bpe-tokenize": KindSpec(
        "tokenizers",
        ("tokenize",),
        (r"<tokenizers::models::bpe::model::BPE as tokenizers::tokenizer::Model>::tokenize",),
        "one call per pre-tokenized word (BPE model), cache hit or not",
    ),
    "hf-bpe-merge": KindSpec(
        "tokenizers",
        ("merge_word",),
        (r"<?tokenizers::models::bpe::model::BPE>?::merge_word",),
        "one call per BPE cache miss (the merge loop itself)",
    ),
    "tiktoken-encode": KindSpec(
        "tiktoken",
        ("encode", "_encode_native"),
        (r"<?tiktoken::CoreBPE>?::encode", r"<?tiktoken::CoreBPE>?::_encode_native"),
        "one call per Encoding.encode()",
    ),
    "tiktoken-encode-ordinary": KindSpec(
        "tiktoken",
        ("encode_ordinary", "_encode_ordinary_native"),
        (
            r"<?tiktoken::CoreBPE>?::encode_ordinary",
            r"<?tiktoken::CoreBPE>?::_encode_ordinary_native",
        ),
        "one call per Encoding.encode_ordinary() (and per item of the batch form)",
    ),
    "tiktoken-bpe": KindSpec(
        "tiktoken",
        ("byte_pair_encode",),
        (r"tiktoken::byte_pair_encode",),
        "one call per regex piece that is not itself a token",
    ),
}

# Libraries we know by module. sentencepiece's wheel exports almost no
# symbols (C++ built with hidden visibility and stripped), so it has no
# kinds: campaigns use the in-process hooks for it.
MODULES: dict[str, str] = {
    "tokenizers": "tokenizers.tokenizers",
    "tiktoken": "tiktoken._tiktoken",
    "sentencepiece": "sentencepiece._sentencepiece",
}
# Checked on the wheel itself (sentencepiece 0.2.3, cp311 manylinux): no
# .symtab, two exported functions (PyInit__sentencepiece and a libstdc++
# string helper).
HIDDEN: dict[str, str] = {
    "sentencepiece": (
        "sentencepiece's wheel hides its symbols (0.2.3: no .symtab, 2 exported "
        "functions, no encode entry point): no probes; campaigns use the in-process "
        "hooks (--target module:callable wrapping SentencePieceProcessor.encode)"
    ),
}
FILE_GLOBS: dict[str, tuple[str, ...]] = {
    "tokenizers": ("tokenizers.abi3.so", "tokenizers.cpython-*.so"),
    "tiktoken": ("_tiktoken.abi3.so", "_tiktoken.cpython-*.so", "_tiktoken*.so"),
    "sentencepiece": ("_sentencepiece*.so",),
}

_V0_HASH = re.compile(r"\[[0-9a-f]+\]")
_LEGACY_HASH = re.compile(r"::h[0-9a-f]{16}$")


def _length_prefixed(word: str) -> str:
    return f"{len(word)}{word}"


def demangle(name: str) -> str:
    """Demangle a Rust symbol (v0 or legacy) into its hash-free form, with
    compiler suffixes (.llvm.N) dropped; other names come back unchanged.
    Never raises. (pyctl/symbols/demangle.py does the reading.)"""
    if not (name.startswith("_R") or name.startswith("_ZN")):
        return name
    # lazy: pyctl.symbols.demangle (ctypes, +4 modules) only when this runs
    from pyctl.symbols.demangle import demangle as read

    # rust_demangler 1.0 prints fragments of names it cannot parse to
    # stdout; keep that out of our output.
    with contextlib.redirect_stdout(io.StringIO()):
        out = read(name)
    return normalise(out)


_CLONE = re.compile(r"( \[clone [^\]]*\])+$")


def normalise(demangled: str) -> str:
    out = _CLONE.sub("", demangled)  # the patterns match the function, not its clone
    out = _V0_HASH.sub("", out)
    out = _LEGACY_HASH.sub("", out)
    return out.replace("{closure:#", "{closure#").replace("{shim:", "{shim:")


_GENERIC = re.compile(r"(?<=[\w:])<[^<>]*>")


def collapse_generics(name: str) -> str:
    """`<A<B, C>>::f::<D>` -> `<A<..>>::f::<..>`: generic arguments hidden,
    qualified-self brackets (`<T as Trait>::f`) kept."""
    prev = None
    while prev != name:
        prev, name = name, _GENERIC.sub("\x00", name)
    return name.replace("\x00", "<..>")


def _load_segments(f: elf.ElfFile) -> list[tuple[int, int, int]]:
    return [(seg.vaddr, seg.memsz, seg.offset) for seg in f.loads]


def vaddr_to_offset(segments: list[tuple[int, int, int]], vaddr: int) -> int:
    for start, size, off in segments:
        if start <= vaddr < start + size:
            return vaddr - start + off
    raise ValueError(f"address {vaddr:#x} is in no PT_LOAD segment")


def iter_functions(path: str | os.PathLike[str]) -> list[tuple[str, int, int, str]]:
    """(name, st_value, st_size, table) for every defined function in
    .symtab and .dynsym (duplicates across the two are left to callers).
    Cached per (path, size, mtime): demangling callers ask several times."""
    st = os.stat(path)
    return _functions(os.fspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _functions(path: str, _size: int, _mtime: int) -> list[tuple[str, int, int, str]]:
    out: list[tuple[str, int, int, str]] = []
    with elf.ElfFile.open(path) as f:
        for table in (".symtab", ".dynsym"):
            for name, value, size, _info in f.functions(table, (elf.STT_FUNC,)):
                out.append((name, value, size, table))
    return out


def symbol_tables(path: str | os.PathLike[str]) -> dict[str, int]:
    """How many defined functions each symbol table holds (0 if absent)."""
    counts = {".symtab": 0, ".dynsym": 0}
    for _name, _v, _s, table in iter_functions(path):
        counts[table] += 1
    return counts


def find_entry_points(path: str | os.PathLike[str], kind: str) -> list[EntryPoint]:
    """The functions of `kind` in the shared object at `path`.

    Raises KeyError for an unknown kind and LookupError, naming the
    patterns searched, when the file has no matching symbol."""
    if kind not in KINDS:
        raise KeyError(f"unknown kind {kind!r}; choose one of: {', '.join(sorted(KINDS))}")
    spec = KINDS[kind]
    needles = tuple(_length_prefixed(w) for w in spec.idents)
    regexes = [re.compile(p) for p in spec.patterns]
    found: dict[int, EntryPoint] = {}
    candidates: list[tuple[int, str, str, int, int]] = []
    for name, value, size, _table in iter_functions(path):
        if not any(n in name for n in needles):
            continue
        dem = demangle(name)
        for rank, rx in enumerate(regexes):
            if rx.fullmatch(dem):
                candidates.append((rank, name, dem, value, size))
                break
    if not candidates:
        counts = symbol_tables(path)
        try:
            # lazy: rust_demangler only for a library with Rust names (tokenizers)
            import rust_demangler  # noqa: F401
        except ImportError:
            raise LookupError(
                f"cannot read the Rust names of {path}: rust-demangler is missing "
                "(pip install rust-demangler; the gpufault wheel depends on it)"
            ) from None
        raise LookupError(
            f"no {kind} symbol in {path} (searched {counts['.symtab']} .symtab and "
            f"{counts['.dynsym']} .dynsym functions for: {' | '.join(spec.patterns)}); "
            "if this build is stripped, use the in-process hooks (--target hf|tiktoken)"
        )
    # The first pattern is the current layout; fall back only if it is absent.
    best = min(c[0] for c in candidates)
    with elf.ElfFile.open(path) as f:
        segs = _load_segments(f)
        for rank, name, dem, value, size in candidates:
            if rank != best or value in found:
                continue
            off = vaddr_to_offset(segs, value)
            first = f.read(off, 8)
            found[value] = EntryPoint(name, dem, value, size, off, str(path), kind, first.hex())
    return sorted(found.values(), key=lambda e: e.address)


def library_of_module(library: str) -> Path:
    """The shared object of an importable tokenizer library."""
    if library not in MODULES:
        raise KeyError(f"unknown library {library!r}; known: {', '.join(sorted(MODULES))}")
    try:
        mod = importlib.import_module(MODULES[library])
    except ImportError as e:
        raise LookupError(f"{library} is not importable here ({e}); pip install {library}") from e
    file = getattr(mod, "__file__", None)
    if not file:
        raise LookupError(f"{MODULES[library]} has no __file__ (built in?)")
    return Path(file)


def libraries_of_pid(pid: int) -> dict[str, Path]:
    """The tokenizer shared objects a running process maps, by library.

    Paths come from /proc/PID/maps; we return /proc/PID/root/<path> when the
    process has another root (a container), or /proc/PID/map_files/RANGE
    when that path leads elsewhere now, so the file we read is the one it
    maps (procfs.mapped_file)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError as e:
        raise LookupError(f"no process {pid}: /proc/{pid}/maps is missing") from e
    except OSError as e:
        raise LookupError(f"cannot read /proc/{pid}/maps ({e.strerror}): run as root") from e
    seen: dict[str, Path] = {}
    # lazy: keeps pyctl.targets (+2 modules) off `--help`
    from pyctl.targets import procfs

    # Its root when not ours: the host may have another file at that path
    # (or none); a chroot in our mounts has its files named from our root;
    # a path in a container's root may lead elsewhere than the mapped file.
    pre = procfs.chroot_prefix(pid)
    inodes = procfs.mapped_inodes(pid) if procfs.root_prefix(pid) else {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = procfs.in_view(fields[5], pre)
        base = os.path.basename(path)
        for lib, globs in FILE_GLOBS.items():
            if lib not in seen and any(Path(base).match(g) for g in globs):
                seen[lib] = Path(procfs.mapped_file(pid, path, inodes))
    return seen


def resolve_library(spec: str) -> Path:
    """`spec` is a library name ('tokenizers', 'tiktoken'), a path to a .so,
    or 'pid:N:library'."""
    if spec.startswith("pid:"):
        _, pid, lib = (spec.split(":", 2) + [""])[:3]
        libs = libraries_of_pid(int(pid))
        if lib not in libs:
            raise LookupError(
                f"process {pid} maps no {lib or '?'} library (found: {', '.join(libs) or 'none'})"
            )
        return libs[lib]
    if os.sep in spec or spec.endswith(".so"):
        p = Path(spec)
        if not p.is_file():
            raise LookupError(f"{spec}: no such file")
        return p
    return library_of_module(spec)


def kinds_for(library: str) -> list[str]:
    return [k for k, v in KINDS.items() if v.library == library]


@dataclass
class LibraryReport:
    library: str
    path: str | None
    symtab: int
    dynsym: int
    found: dict[str, list[EntryPoint]]
    missing: dict[str, str]
    note: str


def report(library: str) -> LibraryReport:
    """What `gpufault probes` shows for one tokenizer library."""
    try:
        path = library_of_module(library)
    except LookupError as e:
        return LibraryReport(library, None, 0, 0, {}, {}, HIDDEN.get(library, str(e)))
    counts = symbol_tables(path)
    found: dict[str, list[EntryPoint]] = {}
    missing: dict[str, str] = {}
    for kind in kinds_for(library):
        try:
            found[kind] = find_entry_points(path, kind)
        except LookupError as e:
            missing[kind] = str(e)
    note = ""
    if library in HIDDEN:
        note = (
            HIDDEN[library]
            + f" (here: {counts['.dynsym']} exported, {counts['.symtab']} in .symtab)"
        )
    elif not kinds_for(library):
        note = (
            f"{library} exports {counts['.dynsym']} functions and has "
            f"{counts['.symtab']} in .symtab: no encode entry point to probe; "
            "use the in-process hooks (gpufault tokenizer ... --target module:callable)"
        )
    elif any(e.starts_with_endbr64 for eps in found.values() for e in eps):
        note = "sites starting with endbr64 are single-stepped: probe at +4 for speed"
    return LibraryReport(
        library, str(path), counts[".symtab"], counts[".dynsym"], found, missing, note
    )
