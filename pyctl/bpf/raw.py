"""The bpf(2) system call itself, for the few commands we issue without
libbpf: netchaos's hand-assembled tc filter, and uprobe_multi links (which
libbpf 1.1, Debian 12's, has no API for)."""

from __future__ import annotations

import ctypes
import os

NR_BPF = 321  # x86-64
BPF_LINK_CREATE = 28

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def bpf(cmd: int, attr: ctypes.Array, size: int | None = None) -> int:  # type: ignore[type-arg]
    """bpf(cmd, attr, size); the result (an fd or 0), or OSError with errno."""
    ret = _libc.syscall(
        ctypes.c_long(NR_BPF),
        ctypes.c_long(cmd),
        attr,
        ctypes.c_long(ctypes.sizeof(attr) if size is None else size),
    )
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf({cmd}): {os.strerror(err)}")
    return int(ret)
