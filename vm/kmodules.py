"""Pick the kernel modules a guest needs (9p over virtio) out of an extracted
Debian kernel tree, in load order, decompressed for busybox's insmod.

Debian ships no modules.dep in the .deb (depmod runs at install time), and
this host has no depmod, so dependencies are read from each module's
.modinfo `depends=` string."""

from __future__ import annotations

import lzma
import re
from pathlib import Path

# What the init needs to mount the host root: the 9p file system over
# virtio-pci. Modules that a kernel has built in are simply not found.
WANTED = ("virtio_pci", "9pnet_virtio", "9p")

_SUFFIXES = (".ko.xz", ".ko.zst", ".ko.gz", ".ko")


def _modname(path: Path) -> str:
    name = path.name
    for suf in _SUFFIXES:
        if name.endswith(suf):
            name = name[: -len(suf)]
            break
    # The kernel treats '-' and '_' in module names as the same character.
    return name.replace("-", "_")


def index_modules(moddir: Path) -> dict[str, Path]:
    """Map module name to file for every module under moddir/kernel."""
    out: dict[str, Path] = {}
    for path in sorted((moddir / "kernel").rglob("*.ko*")):
        if path.name.endswith(_SUFFIXES):
            out[_modname(path)] = path
    return out


def read_module(path: Path) -> bytes:
    """The module's ELF bytes; .xz is the only compression Debian uses here."""
    data = path.read_bytes()
    if path.name.endswith(".xz"):
        return lzma.decompress(data)
    if path.name.endswith((".zst", ".gz")):
        raise ValueError(f"{path}: unsupported module compression; decompress it by hand")
    return data


def depends(elf: bytes) -> list[str]:
    """The `depends=` list from a module's .modinfo strings."""
    m = re.search(rb"(?:^|\x00)depends=([^\x00]*)\x00", elf)
    if not m or not m.group(1):
        return []
    return [d.decode().replace("-", "_") for d in m.group(1).split(b",") if d]


def load_order(moddir: Path, wanted: tuple[str, ...] = WANTED) -> list[tuple[str, bytes]]:
    """(name, ELF bytes) for wanted modules and their dependencies, each
    dependency before its users. Wanted names missing from the tree are
    taken to be built in."""
    index = index_modules(moddir)
    order: list[tuple[str, bytes]] = []
    done: set[str] = set()

    def visit(name: str, stack: tuple[str, ...]) -> None:
        if name in done or name not in index:
            return
        if name in stack:
            raise ValueError(f"module dependency cycle: {' -> '.join(stack + (name,))}")
        elf = read_module(index[name])
        for dep in depends(elf):
            visit(dep, stack + (name,))
        done.add(name)
        order.append((name, elf))

    for name in wanted:
        visit(name, ())
    return order


def stage(moddir: Path, dest: Path) -> list[str]:
    """Write the load-ordered, decompressed modules to dest and dest/order."""
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for name, elf in load_order(moddir):
        (dest / f"{name}.ko").write_bytes(elf)
        names.append(name)
    (dest / "order").write_text("".join(f"{n}.ko\n" for n in names))
    return names
