"""Follow /dev/gpufa and store every record in SQLite as it arrives (the
device is pyctl/anchors/, below the evidence it feeds).

For the recorder: one thread calls Ingest.run(); another calls stop(), which
wakes the poll through a pipe (no timeout polling), and run() returns after
storing what was already queued. The database must belong to the thread
that calls run() (SQLite connections are tied to their thread)."""

from __future__ import annotations

import os
import select

from pyctl.anchors.device import AnchorDevice
from pyctl.evidence.anchors import store_records
from pyctl.evidence.sqlitedb import Database


class Ingest:
    def __init__(self, dev: AnchorDevice, db: Database, batch: int = 64) -> None:
        self.dev = dev
        self.db = db
        self.batch = batch
        self.stored = 0
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    def stop(self) -> None:
        """Make run() drain what is queued and return; safe from any thread."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # already asked

    def _drain(self) -> None:
        while True:
            p = select.poll()
            p.register(self.dev.fileno(), select.POLLIN)
            if not p.poll(0):
                return
            self.stored += store_records(self.db, self.dev.read(self.batch))

    def run(self, max_records: int | None = None) -> int:
        """Store records until stop() or until max_records were stored;
        returns how many were stored in total."""
        p = select.poll()
        p.register(self.dev.fileno(), select.POLLIN)
        p.register(self._wake_r, select.POLLIN)
        try:
            while max_records is None or self.stored < max_records:
                ready = {fd for fd, _ in p.poll()}
                if self._wake_r in ready:
                    self._drain()
                    break
                if self.dev.fileno() in ready:
                    self.stored += store_records(self.db, self.dev.read(self.batch))
        finally:
            os.close(self._wake_r)
            os.close(self._wake_w)
        return self.stored
