"""Controllers opening one new database at once (arm_all over the
processes a selector names: each member's child opens the store as the
others do). SQLite's switch to WAL runs no busy handler, so one of them
used to fail at once with "database is locked" (CI saw it in
test_target_select); and the check that a file is gpufault's read its
tables and its user_version in two statements, so another opener's schema
could commit between them ("not a gpufault database (tables: none,
user_version 8)", seen once in about 160 rounds here). Real processes,
released together by one pipe's EOF, each opening the store and writing
its run."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from conftest import requires_root

from pyctl.evidence import store

OPENERS = 8
ROUNDS = 20  # the schema-read race is rare (module docstring): more rounds, more chances


def _opener(gate: int, path: Path) -> None:
    """A child: wait for the gate, open the store, write a run, exit 0; any
    error goes to stderr with exit 1."""
    try:
        os.read(gate, 1)  # EOF when the parent closes its end: all at once
        db = store.open_db(path)
        try:
            store.new_run(db, ["opener", str(os.getpid())], "trace")
        finally:
            db.close()
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - the child reports and exits
        os.write(2, f"opener {os.getpid()}: {e}\n".encode())
        os._exit(1)


@requires_root
def test_openers_of_one_new_database_at_once_all_get_it(tmp_path: Path) -> None:
    for k in range(ROUNDS):
        path = tmp_path / f"r{k}.db"
        r, w = os.pipe()
        pids = []
        for _ in range(OPENERS):
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _opener(r, path)
            pids.append(pid)
        os.close(r)
        os.close(w)
        codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
        assert codes == [0] * OPENERS, f"round {k}: exit codes {codes}"
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            (runs,) = con.execute("SELECT count(*) FROM runs").fetchone()
            (mode,) = con.execute("PRAGMA journal_mode").fetchone()
        finally:
            con.close()
        assert runs == OPENERS and mode == "wal", (runs, mode)
        assert os.stat(path).st_mode & 0o777 == 0o600
