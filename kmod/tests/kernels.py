"""The kernels the kmod tests build for (and boot, where vm/vmrun.py can).

Each entry: where its headers' path is written, how to fetch it, extra
make arguments, and the vmrun kernel name (None: build only).

Sid's 7.x headers expect gcc-16, which bookworm lacks: gcc-12 compiles the
module with the options it does not know turned off (the minimum function
alignment falls back to -falign-functions; BTF is skipped because pahole is
too old for those headers; the counted_by attribute is ignored with a
warning that -Wno-attributes silences, in the kernel's headers only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
BUILD = REPO / "build"


@dataclass(frozen=True)
class Kernel:
    name: str
    kdir_file: Path
    fetch: str
    make_args: tuple[str, ...] = field(default=())
    vm: str | None = None

    def kdir(self) -> Path | None:
        if not self.kdir_file.exists():
            return None
        kdir = Path(self.kdir_file.read_text().strip())
        return kdir if kdir.is_dir() else None


GCC12_FOR_7X = (
    "CC=x86_64-linux-gnu-gcc-12",
    "CONFIG_CC_HAS_MIN_FUNCTION_ALIGNMENT=",
    "CONFIG_DEBUG_INFO_BTF_MODULES=",
    "KCFLAGS=-Wno-attributes",
)

KERNELS = {
    "6.1": Kernel(
        "6.1", BUILD / "vm" / "bookworm" / "kdir", "python3 vm/fetch_kernels.py bookworm",
        vm="bookworm",
    ),
    "6.12": Kernel("6.12", BUILD / "kmod" / "k612" / "kdir", "python3 kmod/fetch_deps.py k612"),
    "7.x": Kernel(
        "7.x", BUILD / "kmod" / "k72" / "kdir", "python3 kmod/fetch_deps.py k72",
        make_args=GCC12_FOR_7X, vm="sid",
    ),
}  # fmt: skip
