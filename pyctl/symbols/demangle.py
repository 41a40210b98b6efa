"""C++ (Itanium) and Rust (legacy and v0) names as a person reads them.

C++ and Rust legacy names (`_Z...`) go through libstdc++'s own demangler,
`__cxa_demangle`, loaded with ctypes (libstdc++.so.6 is on every GPU host:
torch and CUDA need it), so names read exactly as gdb and c++filt print
them. Rust v0 names (`_R...`) go through rust-demangler. A name neither
understands is returned unchanged, never guessed at.
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections.abc import Iterator

# Rust legacy: a trailing 17h<16 hex> hash element, noise to a reader.
_RUST_HASH = re.compile(r"::h[0-9a-f]{16}(?=$| \[clone )")
# Suffixes compilers add to a symbol's name: ThinLTO's .llvm.<hash> on
# promoted locals (the H200 host's tokenizers wheel has hundreds), gcc's
# .cold/.isra.N/.part.N/.constprop.N clones. __cxa_demangle reads them on
# _Z names; rust-demangler does not, so they are split off and kept, in
# c++filt's spelling: " [clone .llvm.123]".
_RUST_LEGACY = re.compile(r"^_ZN.*17h[0-9a-f]{16}E")
_SUFFIX = re.compile(r"((?:\.(?:llvm|cold|isra|part|constprop|lto_priv)(?:\.\d+)*)+)$")


def _libstdcxx_names() -> Iterator[str | None]:
    """The soname first; ctypes.util's search (it imports subprocess and
    runs ldconfig: ~15 ms of a trace's start) only when that fails."""
    yield "libstdc++.so.6"
    # lazy: keeps ctypes (locale, selectors, +9 modules) off trace's start and `--help`
    import ctypes.util

    yield ctypes.util.find_library("stdc++")


@functools.lru_cache(maxsize=1)
def _cxa() -> tuple[object, object] | None:
    for name in _libstdcxx_names():
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        f = lib.__cxa_demangle
        f.restype = ctypes.c_void_p
        f.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_int)]
        libc = ctypes.CDLL(None)
        libc.free.argtypes = [ctypes.c_void_p]
        return f, libc.free
    return None


def _itanium(name: str) -> str | None:
    cxa = _cxa()
    if cxa is None:
        return None
    f, free = cxa
    status = ctypes.c_int(0)
    p = f(name.encode(), None, None, ctypes.byref(status))  # type: ignore[operator]
    if not p:
        return None
    try:
        return ctypes.string_at(p).decode(errors="replace")
    finally:
        free(p)  # type: ignore[operator]


def _rust_v0(name: str) -> str | None:
    """rust-demangler: v0 names, and legacy ones (it reads both)."""
    try:
        # lazy: rust_demangler only for a Rust name (none on a C++ trace's path)
        import rust_demangler
    except ImportError:
        return None
    try:
        out = rust_demangler.demangle(name)
    except Exception:  # noqa: BLE001 - not a v0 name after all
        return None
    return out if isinstance(out, str) and out != name else None


@functools.lru_cache(maxsize=65536)
def demangle(name: str) -> str:
    """The readable form of a symbol name; the name itself if it is not
    mangled or cannot be read. A version suffix (@GLIBC_2.2.5) is kept."""
    base, at, version = name.partition("@")
    out: str | None = None
    if base.startswith("_R"):
        m = _SUFFIX.search(base)
        out = _rust_v0(base[: m.start()] if m else base)
        if out is not None and m:
            out += "".join(f" [clone {c}]" for c in _clones(m.group(1)))
    elif _RUST_LEGACY.search(base):
        # Rust legacy looks like C++ but escapes <, >, etc. as $LT$...:
        # rust-demangler reads those, __cxa_demangle does not.
        m = _SUFFIX.search(base)
        out = _rust_v0(base[: m.start()] if m else base) or _itanium(base)
        if out is not None:
            out = _RUST_HASH.sub("", out)
            if m and "[clone" not in out:
                out += "".join(f" [clone {c}]" for c in _clones(m.group(1)))
    elif base.startswith("_Z"):
        out = _itanium(base)
    if out is None:
        return name
    return out + (at + version if at else "")


def _clones(suffix: str) -> list[str]:
    """'.llvm.123' -> ['.llvm.123']; '.isra.0.cold' -> ['.isra.0', '.cold']."""
    return re.findall(r"\.[a-z_]+(?:\.\d+)*", suffix)
