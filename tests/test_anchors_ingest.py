"""Ingest: follow a record stream into SQLite. The module cannot load on
this host, so a named pipe carrying synthetic records stands in for
/dev/gpufa here (a test double of the device file: read() and poll() only);
the real device is exercised by tests/test_kmod_vm.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import sqlite_utils

from pyctl.anchors import AnchorDevice, uapi
from pyctl.anchors.synth import make_record
from pyctl.evidence.anchor_ingest import Ingest
from pyctl.evidence.anchors import by_fault


@pytest.fixture
def fifo(tmp_path: Path):
    """(reader AnchorDevice on a FIFO, writer fd)."""
    path = tmp_path / "gpufa.fifo"
    os.mkfifo(path)
    r = AnchorDevice(str(path), nonblock=True)  # open O_NONBLOCK: no writer yet
    w = os.open(path, os.O_WRONLY)
    yield r, w
    r.close()
    os.close(w)


def test_ingest_stores_until_count(fifo, tmp_db: Path) -> None:
    dev, w = fifo
    db = sqlite_utils.Database(tmp_db)
    begin = make_record(kind=uapi.Anchor.RESET_BEGIN, rec_seq=1)
    end = make_record(kind=uapi.Anchor.RESET_END, rec_seq=2)
    os.write(w, bytes(begin) + bytes(end))
    assert Ingest(dev, db).run(max_records=2) == 2
    assert [r["kind"] for r in by_fault(db, "1a2b3c4d-7")] == ["reset_begin", "reset_end"]


def test_stop_wakes_and_drains(fifo, tmp_db: Path) -> None:
    dev, w = fifo
    made = threading.Event()
    box: list[Ingest] = []

    def run() -> None:
        # SQLite connections belong to the thread that made them.
        box.append(Ingest(dev, sqlite_utils.Database(tmp_db)))
        made.set()
        box[0].run()

    t = threading.Thread(target=run)
    t.start()
    assert made.wait(10)
    ing = box[0]
    os.write(w, bytes(make_record(rec_seq=1)))
    # stop() while the record may still be unread: it is stored anyway.
    ing.stop()
    t.join(timeout=10)
    assert not t.is_alive()
    assert ing.stored == 1
    assert sqlite_utils.Database(tmp_db)["anchors"].count == 1


def test_missing_device_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="insmod gpufa.ko"):
        AnchorDevice(str(tmp_path / "nope"))
