"""A consistent copy of the agent's evidence store for `pull`.

SQLite's online backup of a read-only connection (store.open_db checks
the file as every reader does) into a private directory beside the store
(the store's directory was just checked: root's, writable by no one
else), switched out of WAL so the copy is one self-contained file. The
copy is hashed, sent in chunks and removed, whatever happens.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pyctl.api.errors import BadInput
from pyctl.evidence import store


@dataclass(frozen=True)
class Snapshot:
    path: str
    size: int
    sha256: str
    runs: int
    running: int  # runs still armed on the agent: a later pull brings them ended

    def chunks(self, n: int) -> Iterator[str]:
        with open(self.path, "rb") as f:
            while data := f.read(n):
                yield base64.b64encode(data).decode("ascii")

    def facts(self) -> dict[str, object]:
        return {"bytes": self.size, "sha256": self.sha256, "runs": self.runs,
                "running": self.running}  # fmt: skip


@contextmanager
def taken(db: str) -> Iterator[Snapshot]:
    if not db or not os.path.lexists(db):
        raise BadInput(f"this agent has no evidence yet ({db}): nothing was armed through it")
    src = store.open_db(db, readonly=True)
    tmpd = ""
    try:
        tmpd = tempfile.mkdtemp(prefix=".gf-pull-", dir=os.path.dirname(os.path.abspath(db)))
        path = os.path.join(tmpd, "snapshot.db")
        dst = sqlite3.connect(path)
        try:
            src.conn.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")
            runs, running = dst.execute(
                "SELECT count(*), coalesce(sum(status = 'running'), 0) FROM runs"
            ).fetchone()
        finally:
            dst.close()
        src.close()
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while data := f.read(1 << 20):
                h.update(data)
        yield Snapshot(path, os.path.getsize(path), h.hexdigest(), int(runs), int(running))
    finally:
        src.close()
        if tmpd:
            shutil.rmtree(tmpd, ignore_errors=True)


__all__ = ["Snapshot", "taken"]
