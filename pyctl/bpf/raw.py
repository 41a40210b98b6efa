"""The bpf(2) system call itself, for the few commands we issue without
libbpf: netchaos's hand-assembled tc filter, uprobe_multi links (which
libbpf 1.1, Debian 12's, has no API for), and the copilot's pending-entry
lookup, made without letting go of the GIL (pyctl/heldcalls.py says why)."""

from __future__ import annotations

import ctypes
import os

NR_BPF = 321  # x86-64
BPF_MAP_LOOKUP_AND_DELETE_ELEM = 21
BPF_LINK_CREATE = 28

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_held = ctypes.PyDLL(None, use_errno=True)  # calls that keep the GIL
_held.syscall.restype = ctypes.c_long


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


class _MapElemAttr(ctypes.Structure):
    """union bpf_attr as the BPF_MAP_*_ELEM commands read it."""

    _fields_ = [
        ("map_fd", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("key", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


def map_lookup_and_delete_held(fd: int, key: ctypes._CData, value: ctypes._CData) -> bool:
    """bpf_map_lookup_and_delete_elem, keeping the GIL (the copilot's fetch,
    with a target thread stopped meanwhile): True when the key was there
    (value filled)."""
    attr = _MapElemAttr(map_fd=fd, key=ctypes.addressof(key), value=ctypes.addressof(value))
    ret = _held.syscall(
        ctypes.c_long(NR_BPF),
        ctypes.c_long(BPF_MAP_LOOKUP_AND_DELETE_ELEM),
        ctypes.byref(attr),
        ctypes.c_long(ctypes.sizeof(attr)),
    )
    return ret == 0
