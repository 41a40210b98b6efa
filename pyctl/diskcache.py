"""gpufault's on-disk cache: what is slow to learn and cannot change under
a key, kept between runs so `gpufault trace --pid` attaches in milliseconds.

- `symtab/<build-id>`: a file's function table (pyctl/symbols/symtab.py) and the
  probe-site table of pyctl/symbols/resolve.py. A build-id (pyctl/elf.py's
  build_id) names one build's bytes, so an entry never goes stale; a file
  without a build-id is never cached.
- `caps/<boot-id>-<kernel release>.json`: the kernel's trial loads
  (pyctl/bpf/features.py). What the verifier and the uprobe_multi link
  accept does not change within one boot of one kernel.

Where: $GPUFAULT_CACHE_DIR (tests), else /var/cache/gpufault. Root-only
(0700 dirs, 0600 files): symbol tables of a container's libraries are not
every user's to read, and a cache another user could write would let them
choose where our probes go. An entry owned by anyone but us, or a dir
others may write, is ignored. Writes are atomic (a temp file renamed into
place): two runs starting at once, or a run killed mid-write, leave a
whole entry or none. Every failure (read-only /var, full disk) means "no
cache", never an error: the cache only saves time.
"""

from __future__ import annotations

import json
import os
import pickle
import stat
from pathlib import Path
from typing import Any

DEFAULT_DIR = "/var/cache/gpufault"
# Bumped when what an entry holds changes shape: old entries are then
# never read (a new name), and never mistaken for the new layout.
FORMAT = 1


def root_dir() -> Path | None:
    """The cache dir, or None when caching is off (GPUFAULT_CACHE_DIR="")."""
    d = os.environ.get("GPUFAULT_CACHE_DIR")
    if d == "":
        return None
    return Path(d or DEFAULT_DIR)


def _safe_dir(d: Path, create: bool) -> bool:
    try:
        if create:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.lstat()
    except OSError:
        return False
    # Ours and not writable by others: nobody else picks our entries.
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _path(kind: str, key: str, create: bool) -> Path | None:
    base = root_dir()
    if base is None or not key or "/" in key or key.startswith("."):
        return None
    d = base / kind
    if not (_safe_dir(base, create) and _safe_dir(d, create)):
        return None
    return d / f"{key}.v{FORMAT}"


def _read(kind: str, key: str) -> bytes | None:
    p = _path(kind, key, create=False)
    if p is None:
        return None
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError:
        return None
    finally:
        os.close(fd)


def has(kind: str, key: str) -> bool:
    p = _path(kind, key, create=False)
    return p is not None and p.is_file()


def _write(kind: str, key: str, data: bytes) -> bool:
    p = _path(kind, key, create=True)
    if p is None:
        return False
    tmp = None
    try:
        import tempfile  # lazy: on a write only: a warm start imports none of it

        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=p.parent)  # 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
        return True
    except OSError:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False


def load_obj(kind: str, key: str) -> Any | None:
    """A pickled entry, or None. Pickle is safe here only because the dir and
    the file are checked to be ours and written by nobody else (above)."""
    raw = _read(kind, key)
    if raw is None:
        return None
    try:
        return pickle.loads(raw)  # noqa: S301 - our own root-only file
    except Exception:  # noqa: BLE001 - a torn or foreign entry: no cache
        return None


def store_obj(kind: str, key: str, obj: Any) -> bool:
    return _write(kind, key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def boot_key() -> str:
    """'<boot id>-<kernel release>', or '' when either cannot be read."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    return f"{boot}-{os.uname().release}" if boot else ""


def load_caps() -> dict[str, Any]:
    key = boot_key()
    raw = _read("caps", key) if key else None
    if raw is None:
        return {}
    try:
        out = json.loads(raw)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def store_cap(name: str, value: Any) -> None:
    """Add one capability to this boot's entry (read, merge, atomic replace)."""
    key = boot_key()
    if not key:
        return
    caps = load_caps()
    caps[name] = value
    _write("caps", key, json.dumps(caps, sort_keys=True).encode())
