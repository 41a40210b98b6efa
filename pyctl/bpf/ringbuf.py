"""Reading BPF ring buffers from Python without a callback per record.

The kernel maps a ring as: one consumer page (ours, read-write), then one
producer page and the data area mapped twice in a row (read-only), so a
record that wraps is still contiguous. We read the positions, then parse
everything between them in one go: for fixed-size records a single
struct.iter_unpack over the bytes (the batch path), else a header walk.
Waiting is the owner's job: epoll on the map fd (one epoll for all rings).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator

BUSY = 1 << 31
DISCARD = 1 << 30
HDR = 8
_HDR = struct.Struct("=II")
PAGE = mmap.PAGESIZE


def _round8(n: int) -> int:
    return (n + 7) & ~7


class RingReader:
    def __init__(self, map_fd: int, size: int):
        self.fd = map_fd
        self.size = size
        self.mask = size - 1
        self.cons = mmap.mmap(map_fd, PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.prod = mmap.mmap(map_fd, PAGE + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=PAGE)
        self.data = memoryview(self.prod)[PAGE:]
        # The two positions as one aligned 8-byte word each. The kernel
        # reads consumer_pos with one load while it reserves, so ours must
        # change in one store: struct.pack_into zeroes its 8 bytes and then
        # writes them one by one, and a reservation in between saw a
        # position up to the whole ring behind, took the ring for full and
        # failed (the "unexplained" losses at 300k events/s,
        # docs/benchmarks.md). A memoryview cast to "Q" reads and writes an
        # item with one 8-byte memcpy, which the compiler makes one move.
        self._cons_pos = memoryview(self.cons).cast("Q")
        self._prod_pos = memoryview(self.prod)[:8].cast("Q")

    def close(self) -> None:
        self._cons_pos.release()
        self._prod_pos.release()
        self.data.release()
        self.prod.close()
        self.cons.close()

    def _positions(self) -> tuple[int, int]:
        return self._cons_pos[0], self._prod_pos[0]

    def _commit(self, pos: int) -> None:
        self._cons_pos[0] = pos

    def pending_bytes(self) -> int:
        c, p = self._positions()
        return p - c

    def read_fixed(self, rec: struct.Struct, limit: int = 65536) -> list[tuple]:
        """Up to `limit` committed records of one fixed size `rec` (header
        included). Returns tuples whose first two fields are the ring header.
        Stops at the first record a producer is still writing.
        """
        cons, prod = self._positions()
        if cons == prod:
            return []
        step = rec.size
        if step & 7:
            raise ValueError("record format must be a multiple of 8 bytes")
        n = min((prod - cons) // step, limit)
        start = cons & self.mask
        chunk = self.data[start : start + n * step]
        # Header words, one per record, scanned at C speed: lengths are far
        # below 2**30, so any BUSY/DISCARD flag makes the maximum that large.
        hdrs = chunk.cast("I")[:: step // 4]
        flagged = max(hdrs) >= DISCARD
        if flagged:
            for i, h in enumerate(hdrs):
                if h & BUSY:
                    n = i
                    chunk = chunk[: n * step]
                    break
        rows = list(rec.iter_unpack(chunk))
        self._commit(cons + n * step)
        if flagged:
            # Every record here has the same size, so a discarded one still
            # spans one step: drop it after counting it consumed.
            rows = [r for r in rows if not r[0] & DISCARD]
        return rows

    def take(self, limit: int) -> list[bytes]:
        """Up to `limit` variable-size records, copied, and consumed before
        this returns: a caller that stops early (a time budget) neither
        loses nor re-reads one, unlike breaking out of records()."""
        out: list[bytes] = []
        cons, prod = self._positions()
        start = cons
        while cons < prod and len(out) < limit:
            off = cons & self.mask
            ln, _ = _HDR.unpack_from(self.data, off)
            if ln & BUSY:
                break
            size = ln & ~(BUSY | DISCARD)
            if not ln & DISCARD:
                out.append(bytes(self.data[off + HDR : off + HDR + size]))
            cons += _round8(size + HDR)
        if cons != start:
            self._commit(cons)
        return out

    def take_span(self, limit: int) -> tuple[bytes, int]:
        """Up to `limit` committed records as one copy of the ring's bytes,
        ring headers included (split_span() reads them back), and the
        number of records; consumed before this returns. One copy a batch
        instead of one per record: what the fires ring's burst path needs."""
        cons, prod = self._positions()
        start, n = cons, 0
        while cons < prod and n < limit:
            ln = _HDR.unpack_from(self.data, cons & self.mask)[0]
            if ln & BUSY:
                break
            cons += _round8((ln & ~(BUSY | DISCARD)) + HDR)
            n += 1
        if cons == start:
            return b"", 0
        off = start & self.mask
        span = bytes(self.data[off : off + (cons - start)])  # data is mapped twice
        self._commit(cons)
        return span, n

    def records(self) -> Iterator[memoryview]:
        """Walk variable-size records one by one (for the low-rate ring)."""
        cons, prod = self._positions()
        while cons < prod:
            off = cons & self.mask
            ln, _ = _HDR.unpack_from(self.data, off)
            if ln & BUSY:
                break
            total = _round8((ln & ~(BUSY | DISCARD)) + HDR)
            if not ln & DISCARD:
                yield self.data[off + HDR : off + HDR + (ln & ~(BUSY | DISCARD))]
            cons += total
            self._commit(cons)


def split_span(span: bytes) -> list[bytes]:
    """The records of a take_span() copy, discarded ones left out."""
    out, off = [], 0
    while off < len(span):
        ln = _HDR.unpack_from(span, off)[0]
        size = ln & ~(BUSY | DISCARD)
        if not ln & DISCARD:
            out.append(span[off + HDR : off + HDR + size])
        off += _round8(size + HDR)
    return out
