"""Load and unload a kernel module with finit_module/delete_module directly:
no kmod tools needed, and fast enough for load/unload loops in a slow VM."""

from __future__ import annotations

import ctypes
import os
import platform

# System call numbers; the generic table (arm64, riscv) differs from x86-64.
_NR = {
    "x86_64": {"finit_module": 313, "delete_module": 176},
    "aarch64": {"finit_module": 273, "delete_module": 106},
}

_libc = ctypes.CDLL(None, use_errno=True)


def _nr(name: str) -> int:
    arch = platform.machine()
    if arch not in _NR:
        raise OSError(f"module loading: unsupported architecture {arch}")
    return _NR[arch][name]


def insmod(path: str, params: str = "") -> None:
    """Load the module file with the parameter string; OSError on failure."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        ret = _libc.syscall(_nr("finit_module"), fd, params.encode(), 0)
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"insmod {os.path.basename(path)} {params}: {os.strerror(err)}")
    finally:
        os.close(fd)


def rmmod(name: str) -> None:
    """Unload without waiting: EBUSY while a file of the module is open."""
    ret = _libc.syscall(_nr("delete_module"), name.encode(), os.O_NONBLOCK)
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"rmmod {name}: {os.strerror(err)}")


def loaded(name: str) -> bool:
    return os.path.exists(f"/sys/module/{name}")
