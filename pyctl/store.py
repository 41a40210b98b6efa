"""The evidence store: one SQLite file per host (or per --db), written by one
process at a time.

The schema is pyctl/evidence/schema.py; the connection is plain sqlite3
with a few table helpers (pyctl/evidence/sqlitedb.py, not sqlite-utils:
its import alone cost 50-110 ms of every start). The hot ingest path (call
events) uses a plain executemany in batched transactions (see
docs/benchmarks.md).

Safety: the file and its WAL/SHM siblings are created 0600 under a umask
of 077, so the evidence (registers, arguments, stacks) is readable only by
root. Every batch is one transaction, so a killed controller leaves every
committed row intact and no half-written one. open_db() checks the path
before anything is written (no symlink, SQLite, gpufault's or new) and
opens read-only for readers (faults, show): see docs/cli.md.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pyctl.evidence import schema
from pyctl.evidence.schema import SCHEMA_VERSION
from pyctl.evidence.sqlitedb import Database

DEFAULT_DB = Path("/var/lib/gpufault/gpufault.db")


def fault_id(run_id: str, seq: int) -> str:
    """Render the fault ID of the seq-th fire in a run: '1a2b3c4d-7'."""
    return f"{run_id}-{seq}"


class StoreError(Exception):
    """A one-line, user-facing problem with --db (found before anything is
    armed, or a write that failed mid-run)."""


SQLITE_MAGIC = b"SQLite format 3\x00"


def _is_default(p: Path) -> bool:
    try:
        return os.path.abspath(p) == os.path.abspath(DEFAULT_DB)
    except (OSError, ValueError):
        return False


def _check_path(p: Path) -> os.stat_result | None:
    """lstat the database path: refuse a symlink (O_NOFOLLOW semantics) or
    anything but a regular file. None: it does not exist."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StoreError(f"{p}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(f"{p}: is a symbolic link; pass the real path of the database")
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"{p}: not a regular file")
    return st


def _open_nofollow(p: Path, mode: int) -> int:
    """An fd of the existing database, never through a symlink."""
    try:
        return os.open(p, mode | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise StoreError(f"{p}: {e.strerror}") from None


def _check_header(fd: int, p: Path) -> None:
    head = os.pread(fd, len(SQLITE_MAGIC), 0)
    if head and head != SQLITE_MAGIC:
        raise StoreError(f"{p}: not an SQLite database; pass another --db")


def _check_ours(db: Database, p: Path) -> None:
    """Empty (new) or gpufault's: nothing else is touched."""
    try:
        names = [
            r[0]
            for r in db.conn.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
        ]
        version = db.conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{p}: {e}") from None
    if not names and version == 0:
        return
    # Ours at this version or an earlier one (migrated by ensure_schema, or
    # overlaid for a reader); version 0 with tables was never open_db's.
    if "runs" in names and 1 <= version <= SCHEMA_VERSION:
        return
    if "runs" in names and version > SCHEMA_VERSION:
        raise StoreError(f"{p}: written by a newer gpufault (schema {version}); use that one")
    raise StoreError(
        f"{p}: not a gpufault database (tables: {', '.join(sorted(names)[:5]) or 'none'}"
        f", user_version {version}); pass another --db"
    )


def open_db(path: str | os.PathLike[str] = DEFAULT_DB, *, readonly: bool = False) -> Database:
    """Open the store, checked before anything is written.

    Writable (trace, inject): refuses a symlink, a non-regular file, a file
    that is not SQLite, and an SQLite database that is not gpufault's (or
    empty); creates the file 0600 with O_CREAT|O_EXCL|O_NOFOLLOW (never
    through a wider mode, never through a link); creates missing parent
    directories only for the default path (0700); WAL, schema applied.
    Raises StoreError with a one-line message.

    readonly (faults, show): the file must exist and be gpufault's; opened
    with SQLite's mode=ro (and immutable=1 when no writer's WAL is there),
    so nothing is created, converted or chmodded.
    """
    p = Path(path)
    st = _check_path(p)
    if readonly:
        return _open_readonly(p, st)
    created = False
    old = os.umask(0o077)
    try:
        if st is None:
            if not p.parent.is_dir():
                if not _is_default(p):
                    raise StoreError(
                        f"{p.parent}: no such directory (create it, or pass another --db)"
                    )
                try:
                    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                    os.chmod(p.parent, 0o700)
                except OSError as e:
                    raise StoreError(f"{p.parent}: {e.strerror}") from None
            try:
                fd = os.open(
                    p, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
                )
                created = True
            except FileExistsError:
                # Someone created it meanwhile: check it like any existing one.
                _check_path(p)
                fd = _open_nofollow(p, os.O_RDWR)
            except OSError as e:
                raise StoreError(f"{p}: {e.strerror}") from None
        else:
            fd = _open_nofollow(p, os.O_RDWR)
        # Check through our fd, then close it BEFORE SQLite opens the file:
        # closing any fd of a file drops every POSIX lock this process holds
        # on it, SQLite's too (a reader would then take the WAL for
        # abandoned and a writer's commits would be lost).
        try:
            _check_header(fd, p)
            fst = os.fstat(fd)
        except OSError as e:
            raise StoreError(f"{p}: {e.strerror or e}") from None
        finally:
            os.close(fd)
        try:
            db = Database(sqlite3.connect(p, check_same_thread=False))
            try:
                lst = os.lstat(p)
                if (lst.st_dev, lst.st_ino) != (fst.st_dev, fst.st_ino):
                    raise StoreError(f"{p}: replaced while being opened; try again")
                _check_ours(db, p)
                # Evidence is root's alone: our own file, never a foreign one
                # (that was refused above).
                if fst.st_mode & 0o777 != 0o600:
                    os.chmod(p, 0o600)
                db.conn.execute("PRAGMA journal_mode=WAL")
                db.conn.execute("PRAGMA synchronous=NORMAL")
                db.conn.execute("PRAGMA busy_timeout=5000")
                ensure_schema(db)
            except BaseException:
                db.close()
                raise
        except sqlite3.Error as e:
            raise StoreError(f"{p}: {e}") from None
        except OSError as e:
            raise StoreError(f"{p}: {e.strerror or e}") from None
    except BaseException:
        if created:
            remove_db(p)
        raise
    finally:
        os.umask(old)
    for sibling in (Path(f"{p}-wal"), Path(f"{p}-shm")):
        try:
            if stat.S_ISREG(os.lstat(sibling).st_mode):
                os.chmod(sibling, 0o600)
        except OSError:
            pass
    db.gf_created = created
    return db


def _open_readonly(p: Path, st: os.stat_result | None) -> Database:
    if st is None:
        raise StoreError(f"no database at {p}: run gpufault trace/inject first, or pass --db")
    fd = _open_nofollow(p, os.O_RDONLY)
    try:
        _check_header(fd, p)
    finally:
        os.close(fd)
    if st.st_size == 0:
        raise StoreError(f"{p}: empty (no run recorded yet)")
    # No writer's WAL there: immutable, so SQLite creates no -wal/-shm.
    live = os.path.lexists(f"{p}-wal")
    uri = f"file:{quote(str(p.absolute()))}?mode=ro" + ("" if live else "&immutable=1")
    try:
        db = Database(sqlite3.connect(uri, uri=True, check_same_thread=False))
        _check_ours(db, p)
        # An older file is read as the current schema without converting it.
        schema.overlay(db)
    except sqlite3.Error as e:
        raise StoreError(f"{p}: {e}") from None
    return db


def remove_db(p: Path) -> None:
    """Remove a database this process created (a refused start)."""
    for f in (p, Path(f"{p}-wal"), Path(f"{p}-shm")):
        try:
            os.unlink(f)
        except OSError:
            pass


def ensure_schema(db: Database) -> None:
    """Every table of the evidence store, at SCHEMA_VERSION (migrated from
    an older one): pyctl/evidence/schema.py. Idempotent."""
    try:
        schema.ensure_schema(db)
    except schema.SchemaError as e:
        raise StoreError(str(e)) from None


def host_facts() -> dict[str, str]:
    # os.uname(), not platform and socket: the same two strings on Linux,
    # without ~15 ms of imports (secrets, socket) before the probes are live.
    u = os.uname()
    return {"kernel": u.release, "host": u.nodename}


def new_run(
    db: Database,
    argv: Sequence[str],
    kind: str,
    *,
    mechanism: str = "",
    capabilities: dict[str, Any] | None = None,
) -> str:
    """Insert a run row and return its 8-hex run id."""
    run_id = os.urandom(4).hex()  # what secrets.token_hex(4) does
    facts = host_facts()
    with db.conn:
        db["runs"].insert(
            {
                "run_id": run_id,
                "argv": json.dumps(list(argv)),
                "kind": kind,
                "kernel": facts["kernel"],
                "host": facts["host"],
                "mechanism": mechanism,
                "capabilities": json.dumps(capabilities or {}, sort_keys=True),
                "started": time.time(),
                "status": "running",
            }
        )
    return run_id


def end_run(
    db: Database,
    run_id: str,
    status: str,
    exit_code: int | None = None,
    stats: dict[str, Any] | None = None,
) -> None:
    with db.conn:
        db["runs"].update(
            run_id,
            {
                "ended": time.time(),
                "status": status,
                "exit_code": exit_code,
                "stats": json.dumps(stats or {}, sort_keys=True),
            },
        )


# The calls insert, derived from the call record (abi.CALL_FIELDS) in
# pyctl/evidence/schema.py: plain ?s, one per field, no Python per row.
_CALL_RECORD_SQL = schema.call_insert_sql()


def insert_call_records(db: Database, run_id: str, records: list[tuple]) -> None:
    """Insert raw ring records (inside the caller's transaction)."""
    if not all(c in "0123456789abcdef" for c in run_id):
        raise ValueError("run ids are hex")
    db.conn.executemany(_CALL_RECORD_SQL.format(run=run_id), records)
