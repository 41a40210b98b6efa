"""Where to probe: libraries of a process (or on disk) and their symbols.

A library is found in the target's /proc/PID/maps (the exact file it mapped,
through /proc/PID/root so paths inside containers work), by path, or by
soname (the target's LD_LIBRARY_PATH, ldconfig's cache, the usual dirs)
when the target has not loaded it yet. Symbols come from .dynsym and
.symtab, with versioned names (`sym@@VER`) folded, and glob patterns.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from pyctl import elf
from pyctl.exceptions import BadInput
from pyctl.symbols import names


class ResolveError(BadInput):
    """One-line, user-facing: says what was searched and what to do."""


ENDBR64 = bytes.fromhex("f30f1efa")
# First-instruction bytes the kernel emulates instead of single-stepping:
# push %rbp/%rbx/..., push r12-r15 (41 5x), nop.
_CHEAP_FIRST = (b"\x55", b"\x53", b"\x41\x54", b"\x41\x55", b"\x41\x56", b"\x41\x57", b"\x90")


@dataclass(frozen=True)
class Library:
    path: str  # path as opened by us (may go through /proc/PID/root)
    display: str  # path as the target sees it
    dev: int
    inode: int
    mapped: bool  # True when found in the target's maps


@dataclass
class Symbol:
    name: str
    address: int  # st_value (virtual address)
    size: int
    offset: int  # file offset of the probe site
    first_insn: str  # "push", "endbr64", "other"
    skipped_endbr: bool = False
    aliases: list[str] = field(default_factory=list)

    @property
    def slow(self) -> bool:
        """True when the kernel must single-step the first instruction."""
        return self.first_insn == "other"


def pid_alive(pid: int) -> bool:
    """Some thread of pid runs: a zombie (exited, not reaped) does not
    count; a process whose main thread exited while others run does."""
    # lazy: keeps pyctl.procstate (+1 module) off `--help` and `import gpufault`
    from pyctl.procstate import alive

    return alive(pid)


def _proc(pid: int) -> str:
    """/proc/PID, or a live thread's /proc/PID/task/TID when the main thread
    has exited (its own maps, root and environ are then empty or gone)."""
    # lazy: keeps pyctl.procstate (+1 module) off `--help` and `import gpufault`
    from pyctl.procstate import proc_dir

    return proc_dir(pid)


def _maps(pid: int) -> list[str]:
    try:
        text = Path(f"{_proc(pid)}/maps").read_text()
    except FileNotFoundError:
        raise ResolveError(f"no process {pid}: check the pid (is it still running?)") from None
    except PermissionError:
        raise ResolveError(f"cannot read /proc/{pid}/maps: run gpufault as root") from None
    # A chroot in our mounts: maps name its files from our root; the
    # target (and perf's mmap records) from its own. Its view, as stored.
    # lazy: keeps pyctl.targets (+2 modules) off `--help` and `import gpufault`
    from pyctl.targets import procfs

    pre = procfs.chroot_prefix(pid)
    return [ln.replace(" " + pre + "/", " /", 1) if pre else ln for ln in text.splitlines()]


def mapped_files(pid: int) -> list[str]:
    seen: list[str] = []
    for line in _maps(pid):
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            p = parts[5].strip()
            if p.endswith(" (deleted)"):
                continue
            if p not in seen:
                seen.append(p)
    return seen


def _mapped_file(pid: int | None, root: str, path: str) -> str:
    """Where to open the file pid maps at `path`: through its root when
    that is the mapped file, else /proc/PID/map_files (procfs.mapped_file)."""
    if pid is None:
        return root + path
    # lazy: keeps pyctl.targets (+2 modules) off `--help` and `import gpufault`
    from pyctl.targets import procfs

    return procfs.mapped_file(pid, path)


def _mapped_same_file(path: str, pid: int) -> str | None:
    """The path (as pid sees it) of what pid maps that is the file at path:
    the same inode reached by another path (a bind mount, a hard link); or,
    for a process in another root (a container, a chroot), a copy of the
    same build (build-id), which is the file its calls run in. None when
    pid maps neither."""
    # lazy: keeps pyctl.targets (+2 modules) off `--help` and `import gpufault`
    from pyctl.targets import procfs

    try:
        st = os.stat(path)
    except OSError:
        return None
    inodes = procfs.mapped_inodes(pid)
    hit = inodes.get((st.st_dev, st.st_ino))
    if hit is not None or not procfs.root_prefix(pid):
        return hit[0] if hit is not None else None
    want = elf.build_id(path)
    if not want:
        return None
    # Read through the kernel's handle on each mapped file (map_files): the
    # file the target maps, not one a path in its root leads to now.
    base = os.path.basename(path)
    for mapped, handle in sorted(inodes.values(), key=lambda x: os.path.basename(x[0]) != base):
        if elf.build_id(handle) == want:
            return mapped
    return None


def _lib_from(path: str, display: str, mapped: bool) -> Library:
    st = os.stat(path)
    return Library(path, display, st.st_dev, st.st_ino, mapped)


def elf_kind(path: str) -> str:
    """'x86-64' for an x86-64 ELF file, 'elf' for another ELF, '' for
    anything else (a linker script such as libc.so, a text file, a dir)."""
    return elf.kind(path)


def canonical_path(path: str, root: str = "") -> str:
    """path with every link and ./.. resolved, absolute, as a process whose
    root is `root` (its /proc/PID/root; "" for ours) sees it."""
    real = os.path.realpath(path)
    if root:
        top = os.path.realpath(root)
        if top != "/" and (real == top or real.startswith(top + "/")):
            return "/" + os.path.relpath(real, top).removeprefix(".")
    return real


def _is_lib(path: str) -> bool:
    return os.path.isfile(path) and elf_kind(path) == "x86-64"


def _name_matches(basename: str, want: str) -> bool:
    if any(c in want for c in "*?["):
        return fnmatch.fnmatch(basename, want)
    if basename == want:
        return True
    # "libcuda" or "libcuda.so" matches libcuda.so.1, libcuda.so.580.1 ...
    stem = want if want.startswith("lib") else f"lib{want}"
    return bool(re.fullmatch(re.escape(stem) + r"(\.so)?(\.[0-9][\w.]*)?", basename)) or (
        basename.startswith(stem + ".so")
        or basename.startswith(stem + ".cpython")
        or basename.startswith(stem + ".abi3")
    )


_extra_dirs: list[str] = []


def add_search_dirs_for_program(program: str) -> None:
    """Let name lookups see where a program we are about to start would load
    its libraries from: its RUNPATH/RPATH ($ORIGIN expanded)."""
    path = program if "/" in program else shutil.which(program)
    if not path or not os.path.isfile(path):
        return
    origin = os.path.dirname(os.path.realpath(path))
    try:
        with elf.ElfFile.open(path) as f:
            runpath = f.runpath()
    except (OSError, elf.ElfError):  # not an ELF (a script): nothing to add
        return
    for d in runpath:
        d = d.replace("$ORIGIN", origin).replace("${ORIGIN}", origin)
        if d and d not in _extra_dirs:
            _extra_dirs.append(d)


def _search_dirs(pid: int | None) -> list[str]:
    dirs: list[str] = list(_extra_dirs)
    if pid:
        try:
            env = Path(f"{_proc(pid)}/environ").read_bytes().split(b"\0")
            for kv in env:
                if kv.startswith(b"LD_LIBRARY_PATH="):
                    dirs += [d for d in kv[16:].decode(errors="replace").split(":") if d]
        except OSError:
            pass
    dirs += os.environ.get("LD_LIBRARY_PATH", "").split(":")
    dirs += ["/usr/local/nvidia/lib64", "/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu",
             "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib"]  # fmt: skip
    return [d for d in dirs if d]


@lru_cache(maxsize=1)
def _ldconfig() -> dict[str, str]:
    import subprocess  # lazy: only here: ~6 ms of a trace's start otherwise

    out: dict[str, str] = {}
    try:
        text = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return out
    for line in text.splitlines():
        m = re.match(r"\s*(\S+) \(([^)]*)\) => (\S+)", line)
        if m and "x86-64" in m.group(2):
            out.setdefault(m.group(1), m.group(3))
    return out


_SITE_DIRS = ("site-packages", "dist-packages")
_PKG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _pkg_rank(path: str, pkg_dir: str, name: str) -> tuple[int, int, str] | None:
    """How well an extension module under pkg_dir stands for package `name`:
    tiktoken/_tiktoken.cpython-311-x86_64-linux-gnu.so, tokenizers/tokenizers.abi3.so
    first, then any .so at the top of the package, then deeper ones."""
    base = os.path.basename(path)
    if ".so" not in base or not (base.endswith(".so") or ".so." in base):
        return None
    rel = os.path.relpath(path, pkg_dir)
    if rel.startswith(".."):
        return None
    stem = base.split(".", 1)[0]
    return (0 if stem in (name, "_" + name) else 1, rel.count("/"), rel)


def _package_dir_in_maps(path: str, name: str) -> str | None:
    """The package dir `.../site-packages/<name>` a mapped path lies in."""
    parts = path.split("/")
    for i, p in enumerate(parts[:-2]):
        if p in _SITE_DIRS and parts[i + 1] == name:
            return "/".join(parts[: i + 2])
    return None


def _best_extension(cands: list[tuple[str, str, str]], name: str) -> tuple[str, str] | None:
    """(opened path, display path) of the best-ranked ELF extension module
    among (opened path, display path, package dir) candidates."""
    ranked = []
    for opened, display, pkg_dir in cands:
        r = _pkg_rank(display, pkg_dir, name)
        if r is not None and _is_lib(opened):
            ranked.append((r, opened, display))
    if not ranked:
        return None
    ranked.sort()
    return ranked[0][1], ranked[0][2]


def _walk_so(pkg_dir: str, root: str) -> list[tuple[str, str, str]]:
    out = []
    for dirpath, dirnames, files in os.walk(root + pkg_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(files):
            if ".so" in f:
                opened = os.path.join(dirpath, f)
                out.append((opened, opened[len(root) :], pkg_dir))
    return out


def _python_package_lib(want: str, pid: int | None, *, mapped_only: bool) -> Library | None:
    """A Python package's extension module by the package's name
    (`tiktoken` -> .../site-packages/tiktoken/_tiktoken.cpython-*.so).

    mapped_only: only what the target has mapped. Otherwise the package in
    the target's site-packages dirs (those its maps show), then where this
    interpreter would import it from."""
    if not _PKG_NAME.fullmatch(want):
        return None
    root = f"{_proc(pid)}/root" if pid else ""
    files = mapped_files(pid) if pid is not None else []
    if mapped_only:
        cands = [(root + p, p, d) for p in files if (d := _package_dir_in_maps(p, want))]
        hit = _best_extension(cands, want)
        return _lib_from(_mapped_file(pid, root, hit[1]), hit[1], True) if hit else None
    site: list[str] = []
    for p in files:
        parts = p.split("/")
        for i, part in enumerate(parts):
            if part in _SITE_DIRS:
                d = "/".join(parts[: i + 1])
                if d not in site:
                    site.append(d)
    for d in site:
        pkg = f"{d}/{want}"
        if os.path.isdir(root + pkg):
            hit = _best_extension(_walk_so(pkg, root), want)
            if hit:
                return _lib_from(hit[0], hit[1], False)

    try:
        spec = importlib.util.find_spec(want)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        dirs = list(spec.submodule_search_locations)
    elif spec.origin and os.path.basename(spec.origin).split(".", 1)[0] == want:
        dirs = []  # a top-level extension module: tiktoken.cpython-*.so itself
        if _is_lib(spec.origin):
            return _lib_from(spec.origin, spec.origin, False)
    else:
        dirs = []
    for d in dirs:
        hit = _best_extension(_walk_so(d, ""), want)
        if hit:
            return _lib_from(hit[0], hit[1], False)
    return None


def find_library(want: str, pid: int | None = None) -> Library:
    """Resolve --lib: a path, or a name/soname/glob looked up in the target.

    Only x86-64 ELF files count (libc.so is a linker script, not a library).
    Order: what the target maps (by name, then a Python package of that
    name), where it would load it from (LD_LIBRARY_PATH, RUNPATH, the usual
    dirs, ldconfig), then a Python package of that name on disk."""
    root = f"{_proc(pid)}/root" if pid else ""
    if "/" in want:
        # An absolute path is the target's (through its root); a relative
        # one is the caller's, from where gpufault runs.
        for cand in ([root + want] if root and want.startswith("/") else []) + [want]:
            if os.path.isfile(cand):
                kind = elf_kind(cand)
                if kind != "x86-64":
                    what = "an x86-64 ELF file" if kind else "an ELF file (a shared library)"
                    raise ResolveError(
                        f"{want} is not {what}: give the path of a shared library (.so)"
                    )
                # Stored and compared canonical, as the kernel's maps name
                # it: ./build/x or a symlink typed is the file it resolves to.
                real = canonical_path(cand, root if cand.startswith(root + "/") else "")
                mapped = pid is not None and real in mapped_files(pid)
                if pid is not None and not mapped:
                    same = _mapped_same_file(cand, pid)
                    if same is not None:
                        return _lib_from(_mapped_file(pid, root, same), same, True)
                if mapped and cand.startswith(root + "/"):
                    # The mapped file, not one mounted over its path since.
                    return _lib_from(_mapped_file(pid, root, real), real, True)
                return _lib_from(cand, real, mapped)
        raise ResolveError(f"library {want} not found: give an existing path or a soname")
    if pid is not None:
        hits = [
            path
            for path in mapped_files(pid)
            if _name_matches(os.path.basename(path), want) and _is_lib(root + path)
        ]
        if len(hits) > 1:
            # One file under two names (a bind mount, a merged /usr) is one.
            seen: dict[tuple[int, int], str] = {}
            for path in hits:
                try:
                    st = os.stat(root + path)
                except OSError:
                    continue
                seen.setdefault((st.st_dev, st.st_ino), path)
            hits = list(seen.values()) or hits[:1]
        if len(hits) > 1:
            # Two different files of that name in one process (a CUDA build
            # of torch's real libcublas.so.13 beside a test double of the
            # same soname; two copies of one library in two venvs): probing
            # the first would fault the one the caller may not mean, and
            # "never fired" would be the only sign of it.
            raise ResolveError(
                f"--lib {want}: process {pid} maps {len(hits)} libraries of that name "
                f"({', '.join(hits)}): give the path of the one you mean"
            )
        if hits:
            return _lib_from(_mapped_file(pid, root, hits[0]), hits[0], True)
        lib = _python_package_lib(want, pid, mapped_only=True)
        if lib is not None:
            return lib
    # Not loaded (yet): the file the target would load.
    for d in _search_dirs(pid):
        try:
            names = sorted(os.listdir(root + d if root else d))
        except OSError:
            continue
        for n in names:
            if _name_matches(n, want):
                p = os.path.join(d, n)
                if _is_lib(root + p if root else p):
                    return _lib_from(root + p if root else p, p, False)
    for soname, p in _ldconfig().items():
        if _name_matches(soname, want) and _is_lib(p):
            return _lib_from(p, p, False)
    lib = _python_package_lib(want, pid, mapped_only=False)
    if lib is not None:
        return lib
    where = f"process {pid}'s maps, " if pid else ""
    raise ResolveError(
        f"library {want!r} not found in {where}LD_LIBRARY_PATH, ldconfig, the usual "
        "dirs or a Python package of that name: pass --lib /full/path/to/the.so"
    )


# name -> (st_value, st_size); PT_LOADs; build-id; for each address with
# several names, all of them, the canonical one first (names.py).
ElfInfo = tuple[dict[str, tuple[int, int]], list, str, dict[int, list[str]]]
# Keyed by the file itself (device, inode, mtime), not the path: the same
# library is reached as /proc/PID/root/... and as its host path, and a big
# one (libcuda, torch's) takes a second or more to read.
_ELF_CACHE: dict[tuple[int, int, float], ElfInfo] = {}


def _file_key(path: str) -> tuple[int, int, float]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_mtime


def _elf_symbols(path: str) -> ElfInfo:
    """name -> (st_value, st_size) for defined functions; PT_LOADs; build-id."""
    key = _file_key(path)
    info = _ELF_CACHE.get(key)
    if info is None:
        info = _ELF_CACHE[key] = _cached_read_elf(path)
    PARSED_PATHS[path] = None
    return info


# Every path whose symbols were read (the probed libraries, as opened: maybe
# through /proc/PID/root): pyctl/symbols/symbolize.py reads their function tables
# while the target lives, for a target that dies right after its fault.
PARSED_PATHS: dict[str, None] = {}


def _cached_read_elf(path: str) -> ElfInfo:
    """_read_elf through the disk cache, keyed by build-id: one build's
    symbols never change, so no mtime or path is part of the key (the
    same libcuda reached through /proc/PID/root and as its host path is
    one entry). A file without a build-id is parsed every time."""
    # lazy: keeps pyctl.diskcache (pickle, +4 modules) off `--help` and `import gpufault`
    from pyctl import diskcache

    bid = elf.build_id(path)
    if bid:
        hit = diskcache.load_obj("symtab", f"{bid}-sites-{names.CACHE_TAG}")
        if isinstance(hit, tuple) and len(hit) == 4 and hit[2] == bid:
            return hit
    info = _read_elf(path)
    if bid and info[2] == bid:
        diskcache.store_obj("symtab", f"{bid}-sites-{names.CACHE_TAG}", info)
    return info


def _read_elf(path: str) -> ElfInfo:
    syms: dict[str, tuple[int, int]] = {}
    at: dict[int, list[tuple[str, int]]] = {}
    try:
        f = elf.ElfFile.open(path)
    except elf.ElfError:
        raise ResolveError(
            f"{path} is not an ELF file: give the path of a shared library (.so)"
        ) from None
    with f:
        if not f.is_x86_64:
            raise ResolveError(f"{path} is not an x86-64 ELF file")
        try:
            loads = [(s.vaddr, s.offset, s.filesz) for s in f.loads]
            for table in (".dynsym", ".symtab"):
                # STT_GNU_IFUNC stays out, as it always did: its st_value is
                # the resolver, not the function a probe wants.
                for name, value, size, info in f.functions(table, (elf.STT_FUNC,)):
                    name = name.split("@")[0]
                    if name and name not in syms:
                        syms[name] = (value, size)
                    if name:
                        bind = names.BIND_RANK.get(info >> 4, names.UNKNOWN_BIND)
                        at.setdefault(value, []).append((name, bind))
            build_id = f.build_id
        except elf.ElfError as e:
            raise ResolveError(f"cannot read {path}: {e}") from None
    aliases = {a: ranked for a, ns in at.items() if len(ranked := names.ranked(ns)) > 1}
    return syms, loads, build_id, aliases


def is_parsed(path: str) -> bool:
    """Has this library's symbol table been read already (cheap to reuse)?"""
    try:
        return _file_key(path) in _ELF_CACHE
    except OSError:
        return False


def build_id(path: str) -> str:
    return _elf_symbols(path)[2]


def vaddr_to_offset(loads: list, vaddr: int) -> int:
    for v, off, sz in loads:
        if v <= vaddr < v + sz:
            return vaddr - v + off
    raise ResolveError(f"address {vaddr:#x} is not in a loadable segment")


def _classify(head: bytes) -> str:
    if head.startswith(ENDBR64):
        return "endbr64"
    if any(head.startswith(p) for p in _CHEAP_FIRST):
        return "push"
    return "other"


def _tokenizer_kind(lib: Library, kind: str) -> list[str]:
    """`tok:KIND`: the tokenizer entry points found by demangled name."""
    # lazy: keeps pyctl.symbols.tokenizers (+1 module) off trace's start and `--help`
    from pyctl.symbols import tokenizers as toksyms

    try:
        return [e.mangled for e in toksyms.find_entry_points(lib.path, kind)]
    except (KeyError, LookupError) as e:
        raise ResolveError(str(e).strip("'\"")) from None


def _demangled_match(table: dict[str, tuple[int, int]], pattern: str) -> list[str]:
    """Rust/C++ names by their demangled form: `--fn '*BPE*::tokenize'`."""
    # lazy: keeps pyctl.symbols.tokenizers (+1 module) off trace's start and `--help`
    from pyctl.symbols.tokenizers import demangle

    out = []
    for n in table:
        if n.startswith(("_R", "_ZN")) and fnmatch.fnmatchcase(demangle(n), pattern):
            out.append(n)
    return out


def symbols(lib: Library, pattern: str | Sequence[str]) -> list[Symbol]:
    """Functions of lib matching a name or glob, or several (each of which
    must match something). Raises when one matches nothing, naming it.

    Also `tok:KIND` (tokenizer entry points, see `gpufault tokenizer probes`)
    and globs containing '::' matched against demangled Rust/C++ names."""
    if not isinstance(pattern, str):
        pats = list(dict.fromkeys(pattern))
        if not pats:
            raise ResolveError("no --fn given: name a function or a glob (--fn 'cuMemAlloc*')")
        out: dict[int, Symbol] = {}
        for one in pats:
            for sym in symbols(lib, one):
                have = out.get(sym.address)
                if have is None:
                    out[sym.address] = sym
                else:
                    for n in [sym.name, *sym.aliases]:
                        if n != have.name and n not in have.aliases:
                            have.aliases.append(n)
        return list(out.values())
    table, loads, _, aliases = _elf_symbols(lib.path)
    globby = any(c in pattern for c in "*?[")
    if pattern.startswith("tok:"):
        names = _tokenizer_kind(lib, pattern[4:])
    elif "::" in pattern:
        names = _demangled_match(table, pattern)
    else:
        names = fnmatch.filter(table, pattern) if globby else [n for n in table if n == pattern]
    if not names:
        close = [n for n in table if pattern.lower().rstrip("*") in n.lower()][:5]
        hint = f" (close: {', '.join(sorted(close))})" if close else ""
        raise ResolveError(
            f"symbol {pattern!r} not found in {lib.display}{hint}: "
            "list them with `gpufault probes LIB`"
        )
    by_addr: dict[int, Symbol] = {}
    with open(lib.path, "rb") as f:
        for n in sorted(names):
            addr, size = table[n]
            if addr in by_addr:  # aliases (cuMemAlloc and cuMemAlloc_v2 can share code)
                by_addr[addr].aliases.append(n)
                continue
            off = vaddr_to_offset(loads, addr)
            f.seek(off)
            head = f.read(8)
            kind = _classify(head)
            skipped = False
            if kind == "endbr64":
                # Same semantics one instruction later, and ~40x cheaper:
                # the kernel emulates a push, it single-steps endbr64.
                off += 4
                kind = _classify(head[4:])
                skipped = True
            by_addr[addr] = Symbol(n, addr, size, off, kind, skipped)
    for addr, sym in by_addr.items():
        # One name per site, whichever of its names matched: the one a
        # stack frame there is named by too (names.canonical); the others
        # are its aliases (`cuMemAlloc_v2`, alias `cuMemAlloc`).
        if addr in aliases:
            sym.name, *rest = aliases[addr]
            sym.aliases = rest
    return list(by_addr.values())


def all_functions(lib: Library) -> dict[str, tuple[int, int]]:
    return dict(_elf_symbols(lib.path)[0])


VARIANT_SUFFIXES = ("_v2", "_v3", "_v4", "_ptsz", "_ptds", "_v2_ptsz", "_v2_ptds")


def variants(lib: Library, base: str) -> list[str]:
    """Exported variants of a CUDA-style name (cuMemcpy -> cuMemcpy_v2, ...)."""
    table = all_functions(lib)
    return [base + s for s in ("",) + VARIANT_SUFFIXES if base + s in table]
