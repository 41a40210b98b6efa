"""The events ring's positions and the diagnosis of failed reservations.

The kernel reads the consumer position with one 8-byte load each time a
BPF program reserves a record. The consumer (pyctl/bpf/ringbuf.py) used to
write it with struct.pack_into, which zeroes the word and then writes it in
pieces: a reservation in between saw the ring as full and failed (the lost
events at 300k events/s, docs/benchmarks.md). A hardware write watchpoint
on the real ring's consumer page counts the stores one commit makes.
"""

from __future__ import annotations

import ctypes as C
import errno
import fcntl
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from gftarget import LIB, TARGET, Target

from pyctl.bpf.ringbuf import RingReader
from pyctl.engine import Engine
from pyctl.spec import FaultSpec

pytestmark = [pytest.mark.root]

BPF_MAP_CREATE = 0
BPF_MAP_TYPE_RINGBUF = 27
SYS_BPF = 321
SYS_PERF_EVENT_OPEN = 298
PERF_TYPE_BREAKPOINT = 5
HW_BREAKPOINT_W = 2
IOC_ENABLE, IOC_DISABLE, IOC_RESET = 0x2400, 0x2401, 0x2403
ATTR_DISABLED, ATTR_EXCLUDE_KERNEL, ATTR_EXCLUDE_HV = 1 << 0, 1 << 5, 1 << 6

libc = C.CDLL(None, use_errno=True)


class MapAttr(C.Structure):
    _fields_ = [
        ("map_type", C.c_uint32),
        ("key_size", C.c_uint32),
        ("value_size", C.c_uint32),
        ("max_entries", C.c_uint32),
        ("pad", C.c_uint8 * 112),
    ]


class PerfAttr(C.Structure):  # struct perf_event_attr up to bp_len
    _fields_ = [
        ("type", C.c_uint32),
        ("size", C.c_uint32),
        ("config", C.c_uint64),
        ("sample_period", C.c_uint64),
        ("sample_type", C.c_uint64),
        ("read_format", C.c_uint64),
        ("flags", C.c_uint64),
        ("wakeup_events", C.c_uint32),
        ("bp_type", C.c_uint32),
        ("bp_addr", C.c_uint64),
        ("bp_len", C.c_uint64),
    ]


@pytest.fixture
def ring() -> Iterator[RingReader]:
    size = 1 << 16
    attr = MapAttr(map_type=BPF_MAP_TYPE_RINGBUF, max_entries=size)
    fd = libc.syscall(SYS_BPF, BPF_MAP_CREATE, C.byref(attr), C.sizeof(attr))
    assert fd >= 0, os.strerror(C.get_errno())
    r = RingReader(fd, size)
    yield r
    r.close()
    os.close(fd)


def _write_watch(addr: int) -> int:
    """A counting hardware watchpoint on the 8 bytes at addr (this thread)."""
    a = PerfAttr(type=PERF_TYPE_BREAKPOINT, size=C.sizeof(PerfAttr), bp_type=HW_BREAKPOINT_W,
                 bp_addr=addr, bp_len=8)  # fmt: skip
    a.flags = ATTR_DISABLED | ATTR_EXCLUDE_KERNEL | ATTR_EXCLUDE_HV
    fd = libc.syscall(SYS_PERF_EVENT_OPEN, C.byref(a), 0, -1, -1, 0)
    if fd < 0:
        err = C.get_errno()
        if err in (errno.ENOENT, errno.EOPNOTSUPP, errno.ENODEV):
            pytest.skip(f"no hardware watchpoints here ({os.strerror(err)})")
        raise OSError(err, os.strerror(err))
    return fd


def _stores(fd: int, body) -> int:  # type: ignore[no-untyped-def]
    fcntl.ioctl(fd, IOC_RESET, 0)
    fcntl.ioctl(fd, IOC_ENABLE, 0)
    body()
    fcntl.ioctl(fd, IOC_DISABLE, 0)
    return struct.unpack("=Q", os.read(fd, 8))[0]


def test_a_commit_moves_the_consumer_position_in_one_store(ring: RingReader) -> None:
    word = C.c_char.from_buffer(ring.cons)
    addr = C.addressof(word)
    del word  # the export would keep the page from closing
    fd = _write_watch(addr)
    try:
        # Positions that carry across bytes, as a ring's do at each wrap.
        pos = [0x00FF_FFF8 + 0x88 * i for i in range(500)]

        def commit_all() -> None:
            for p in pos:
                ring._commit(p)

        def pack_all() -> None:  # the old way: the watchpoint must see more
            for p in pos:
                struct.pack_into("=Q", ring.cons, 0, p)

        assert _stores(fd, commit_all) == len(pos)
        assert _stores(fd, pack_all) > len(pos)
    finally:
        os.close(fd)
        ring._commit(0)
    assert ring._positions() == (0, 0)


@pytest.mark.skipif(not TARGET.exists(), reason="build/targets/gf_target missing: make build")
def test_a_full_ring_is_diagnosed_as_full(tmp_db: Path) -> None:
    """Calls made while nothing consumes: every loss is the ring being
    full, none is put down to room when looked at."""
    t = Target()
    try:
        spec = FaultSpec(lib=str(LIB), fn="gf_empty", trace=True, entry_only=True,
                         capture_stack=False, tgid=t.pid)  # fmt: skip
        eng = Engine([spec], db_path=tmp_db, pid=t.pid, argv=["test"], ring_mib=1)
        eng.start()
        try:
            t.cmd("empty 20000")  # 1 MiB holds 8,738 records of 120 bytes
            lost = eng.lost()["events_lost"]
            why = eng.loss_causes()
            got = eng.drain()
        finally:
            eng.close()
    finally:
        t.close()
    assert got + lost == 20000
    assert lost > 10000
    assert why["ring_full"] == lost
    assert why["room_when_read"] == 0
    assert (1 << 20) - 128 <= why["backlog_max_bytes"] < 1 << 20
