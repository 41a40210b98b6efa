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
committed row intact and no half-written one. open_db() walks the path by
fd and refuses one another user could swap or read (pyctl/evidence/
dbfile.py), checks an existing file read-only and completely before
anything is written or armed (gpufault's, a schema it can migrate, every
page readable), and opens read-only for readers (faults, show): see
docs/cli.md.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pyctl.bpf import abi
from pyctl.evidence import dbfile, hostid, schema
from pyctl.evidence.schema import SCHEMA_VERSION
from pyctl.evidence.sqlitedb import Database
from pyctl.exceptions import BadInput
from pyctl.paths import DEFAULT_DB


def fault_id(run_id: str, seq: int) -> str:
    """Render the fault ID of the seq-th fire in a run: '1a2b3c4d-7'."""
    return f"{run_id}-{seq}"


class StoreError(BadInput):
    """A one-line, user-facing problem with --db (found before anything is
    armed, or a write that failed mid-run)."""


SQLITE_MAGIC = b"SQLite format 3\x00"


def damaged(e: sqlite3.Error) -> bool:
    """The file's fault, not gpufault's: SQLITE_CORRUPT or SQLITE_NOTADB
    (Python 3.10 has no error codes: there SQLite's corruption arrives as
    the bare DatabaseError class)."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is None:
        return type(e) is sqlite3.DatabaseError
    return code & 0xFF in (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB


# The store this process opened last (open_db): a damaged page that a
# query meets later (SQLITE_CORRUPT from any reader: timeline, calls,
# experiment results/report) names that file in its one line.
_last_opened: str | None = None


def damaged_line(e: BaseException) -> str | None:
    """The one line for a damaged page met while reading the store (the
    line `show`/`faults` print), or None when e is not one: opening checks
    the file's header, owner and schema, not every page (a full check
    would cost a reader seconds on a large store), so a reader can still
    meet one. The CLI's error contract, api.errors.cli_line and translate
    turn it into exit 2 / BadInput."""
    if not isinstance(e, sqlite3.DatabaseError) or not damaged(e):
        return None
    where = _last_opened or "the evidence database"
    return f"{where}: {e}; restore it from a copy or pass another --db"


def _is_default(p: Path) -> bool:
    try:
        return os.path.abspath(p) == os.path.abspath(DEFAULT_DB)
    except (OSError, ValueError):
        return False


def _check_header(fd: int, p: Path) -> bytes:
    head = os.pread(fd, 100, 0)
    if head and not head.startswith(SQLITE_MAGIC):
        raise StoreError(f"{p}: not an SQLite database; pass another --db")
    return head


def _check_ours(db: Database, p: Path) -> None:
    """Empty (new) or gpufault's: nothing else is touched."""
    try:
        # One statement, one snapshot: read apart, another opener's schema
        # could commit between them (no tables, then user_version 8: "not
        # a gpufault database"; tests/test_store_concurrent_open.py).
        rows = db.conn.execute(
            "SELECT v.user_version, m.name FROM pragma_user_version AS v "
            "LEFT JOIN sqlite_master AS m ON m.type = 'table'"
        ).fetchall()
        version = rows[0][0]
        names = [r[1] for r in rows if r[1] is not None]
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


_BUSY_MS = 5000


def _to_wal(conn: sqlite3.Connection) -> None:
    """Switch the file to WAL. SQLite runs no busy handler for this switch
    (it needs the file alone, and a lock wait could deadlock), so two
    controllers opening one new file at once (arm_all over a selector's
    processes) saw "database is locked" at once: read the mode first (a
    file already WAL, every open after the first, takes no lock), else
    retry within the busy timeout's budget; another opener's switch
    while we waited is as good as ours."""
    deadline = time.monotonic() + _BUSY_MS / 1000
    pause = 0.001
    while True:
        try:
            mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
            if str(mode).lower() == "wal":
                return
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() == "wal":
                return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
        if time.monotonic() >= deadline:
            raise sqlite3.OperationalError("database is locked (could not switch it to WAL)")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _uri(path: str, *, immutable: bool) -> str:
    return f"file:{quote(path)}?mode=ro" + ("&immutable=1" if immutable else "")


# The file as a writer last closed it, whole (no -wal left): (size,
# mtime_ns, ctime_ns) by (st_dev, st_ino), in gpufault's root-only cache
# (pyctl/diskcache.py). The file is root's alone in a directory of root's
# alone (dbfile), so only root changes it, and any write moves its ctime,
# which not even root can set back: the same triple means the same bytes
# that were read whole, and quick_check (seconds on a large store) can be
# skipped. Any difference, or no cache, means the full check.
_CHECKED = "dbcheck"


def _file_key(st: os.stat_result) -> str:
    return f"{st.st_dev:x}-{st.st_ino:x}"


def _file_state(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _known_whole(st: os.stat_result) -> bool:
    # lazy: keeps pyctl.diskcache (pickle, +4 modules) off `--help` and `trace --help`
    from pyctl import diskcache

    return diskcache.load_obj(_CHECKED, _file_key(st)) == _file_state(st)


def _note_whole(path: str, ident: tuple[int, int]) -> None:
    """After a writer's close: the file it opened (path: the canonical one
    it walked; ident: its st_dev, st_ino) as it is now, if nothing else
    has it open for writing (its -wal is gone: the last connection
    checkpointed it)."""
    # lazy: keeps pyctl.diskcache (pickle, +4 modules) off `--help` and `trace --help`
    from pyctl import diskcache

    try:
        loc = dbfile.locate(path)
    except (dbfile.UnsafePath, OSError):
        return
    try:
        st = loc.lstat()
        if st is None or (st.st_dev, st.st_ino) != ident:
            return
        if any(loc.lstat(s) is not None for s in ("-wal", "-journal")):
            return
        dbfile.check_file(st, path)
        diskcache.store_obj(_CHECKED, _file_key(st), _file_state(st))
    except (dbfile.UnsafePath, OSError):
        return
    finally:
        loc.close()


def _validate(loc: dbfile.Located, p: Path, *, pages: bool = True) -> None:
    """Everything that could refuse an existing file, on a read-only
    connection and before anything is written, chmod-ed or armed: SQLite
    and gpufault's, a schema ensure_schema can bring to the current one,
    and (pages) every page readable (PRAGMA quick_check: a damaged page
    found mid-run would come after the probes and the copilot)."""
    try:
        con = sqlite3.connect(
            _uri(loc.path, immutable=loc.lstat("-wal") is None), uri=True, check_same_thread=False
        )
    except sqlite3.Error as e:
        raise StoreError(f"{p}: {e}") from None
    try:
        db = Database(con)
        _check_ours(db, p)
        schema.check(db)
        bad = [r[0] for r in con.execute("PRAGMA quick_check(3)")] if pages else ["ok"]
        if bad != ["ok"]:
            raise StoreError(
                f"{p}: damaged ({bad[0][:80]}); restore it from a copy or pass another --db"
            )
    except schema.SchemaError as e:
        raise StoreError(f"{p}: {e}; pass another --db") from None
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{p}: {e}; restore it from a copy or pass another --db") from None
    finally:
        con.close()


def _locate(p: Path, *, writer: bool) -> dbfile.Located:
    """The walk of dbfile.locate, the default path's directories made 0700."""

    def made(fd: int) -> None:
        os.fchmod(fd, 0o700)  # ours, just made: 0700 whatever the umask

    try:
        loc = dbfile.locate(p, mkdirs=writer and _is_default(p), on_mkdir=made)
    except dbfile.UnsafePath as e:
        raise StoreError(str(e)) from None
    if writer and loc.shared:
        try:
            # What another user left there is named first (theirs: the
            # sharper reason), then why the directory will not do.
            st = loc.lstat()
            if st is not None:
                dbfile.check_file(st, str(p))
            loc.check_sidecars()
        except dbfile.UnsafePath as e:
            raise StoreError(str(e)) from None
        finally:
            loc.close()
        raise StoreError(
            f"{loc.dir_path}: other users can create files there (the database's -wal and "
            "-shm would be theirs); pass a --db in a directory only root can write"
        )
    return loc


def _open_file(loc: dbfile.Located, p: Path, *, create: bool) -> tuple[int, bool]:
    """An fd of the database in its checked directory, never through a
    link (O_NOFOLLOW), created O_EXCL 0600 when missing and `create`;
    checked on the fd (dbfile.check_file). True: this call made it."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(2):
        try:
            fd = os.open(loc.name, flags, dir_fd=loc.dir_fd)
            created = False
        except FileNotFoundError:
            if not create:
                raise StoreError(
                    f"no database at {p}: run gpufault trace/inject first, or pass --db"
                ) from None
            try:
                fd = os.open(
                    loc.name,
                    os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=loc.dir_fd,
                )
                created = True
            except FileExistsError:
                continue  # made meanwhile: opened and checked like any other
            except OSError as e:
                raise StoreError(f"{p}: {e.strerror}") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StoreError(
                    f"{p}: is a symbolic link; pass the real path of the database"
                ) from None
            raise StoreError(f"{p}: {e.strerror}") from None
        try:
            dbfile.check_file(os.fstat(fd), str(p))
        except dbfile.UnsafePath as e:
            os.close(fd)
            raise StoreError(str(e)) from None
        return fd, created
    raise StoreError(f"{p}: replaced while being opened; try again")


def open_db(path: str | os.PathLike[str] = DEFAULT_DB, *, readonly: bool = False) -> Database:
    """Open the store, checked before anything is written.

    The path is walked by fd and the file and its sidecars checked on
    fds (pyctl/evidence/dbfile.py says why and how): every directory
    root's and writable by no one else (a sticky one too for a writer),
    the file and any -wal/-shm/-journal a regular file of root's with
    one link, the name itself no symlink. An existing file is then
    checked read-only and completely (_validate: gpufault's, a schema
    this gpufault can migrate, every page readable) before it is
    chmod-ed, switched to WAL or migrated: a refused file is left
    byte for byte as it was.

    Writable (trace, inject): creates the file 0600 with
    O_CREAT|O_EXCL|O_NOFOLLOW; creates missing parent directories only
    for the default path (0700); WAL, schema applied. Raises StoreError
    with a one-line message.

    readonly (faults, show): the file must exist and be gpufault's; opened
    with SQLite's mode=ro (and immutable=1 when no writer's WAL is there),
    so nothing is created, converted or chmodded.
    """
    global _last_opened
    p = Path(path)
    _last_opened = str(path)
    loc = _locate(p, writer=not readonly)
    try:
        if readonly:
            return _open_readonly(loc, p)
        return _open_writable(loc, p)
    finally:
        loc.close()


def _open_writable(loc: dbfile.Located, p: Path) -> Database:
    old = os.umask(0o077)
    created = False
    try:
        fd, created = _open_file(loc, p, create=True)
        try:
            try:
                head = _check_header(fd, p)
                fst = os.fstat(fd)
            except OSError as e:
                raise StoreError(f"{p}: {e.strerror or e}") from None
            try:
                loc.check_sidecars()
            except dbfile.UnsafePath as e:
                raise StoreError(str(e)) from None
            if head:
                # A file with frames in its -wal is not as last closed: read
                # it whole. An empty -wal holds nothing (a reader that opened
                # the file after our last close and is still open, as any
                # script or Datasette does): the file is its content.
                wal = loc.lstat("-wal")
                whole = (wal is None or wal.st_size == 0) and _known_whole(fst)
                _validate(loc, p, pages=not whole)
            # Evidence is root's alone: a file already checked to be root's
            # and gpufault's (or empty), never a foreign one.
            if fst.st_mode & 0o777 != 0o600:
                os.fchmod(fd, 0o600)
        finally:
            # Closed BEFORE SQLite opens the file: closing any fd of a file
            # drops every POSIX lock this process holds on it, SQLite's
            # too (a reader would then take the WAL for abandoned and a
            # writer's commits would be lost).
            os.close(fd)
        try:
            db = Database(sqlite3.connect(loc.path, check_same_thread=False))
            try:
                # Nobody but root can change a name on the walked path:
                # the inode checked is the one SQLite opened.
                if not loc.same_file(fst):
                    raise StoreError(f"{p}: replaced while being opened; try again")
                db.conn.execute(f"PRAGMA busy_timeout={_BUSY_MS}")
                _check_ours(db, p)
                _to_wal(db.conn)
                loc.check_sidecars()
                db.conn.execute("PRAGMA synchronous=NORMAL")
                ensure_schema(db)
                loc.fix_sidecar_modes()
            except BaseException:
                db.close()
                raise
        except dbfile.UnsafePath as e:
            raise StoreError(str(e)) from None
        except sqlite3.Error as e:
            raise StoreError(f"{p}: {e}") from None
        except OSError as e:
            raise StoreError(f"{p}: {e.strerror or e}") from None
    except BaseException:
        if created:
            _remove_in(loc)
        raise
    finally:
        os.umask(old)
    db.gf_created = created
    canon, ident = loc.path, (fst.st_dev, fst.st_ino)
    db.after_close = lambda: _note_whole(canon, ident)
    return db


def _open_readonly(loc: dbfile.Located, p: Path) -> Database:
    fd, _ = _open_file(loc, p, create=False)
    try:
        head = _check_header(fd, p)
        fst = os.fstat(fd)
    finally:
        os.close(fd)
    if not head:
        raise StoreError(f"{p}: empty (no run recorded yet)")
    try:
        loc.check_sidecars()
        # No writer's WAL there: immutable, so SQLite creates no -wal/-shm.
        live = loc.lstat("-wal") is not None
        db = Database(
            sqlite3.connect(_uri(loc.path, immutable=not live), uri=True, check_same_thread=False)
        )
        try:
            if not loc.same_file(fst):
                raise StoreError(f"{p}: replaced while being opened; try again")
            _check_ours(db, p)
            if live:
                loc.check_sidecars()  # the -shm SQLite may just have made
            # An older file is read as the current schema without converting it.
            schema.overlay(db)
        except BaseException:
            db.close()
            raise
    except dbfile.UnsafePath as e:
        raise StoreError(str(e)) from None
    except sqlite3.Error as e:
        raise StoreError(f"{p}: {e}") from None
    return db


def _remove_in(loc: dbfile.Located) -> None:
    """Unlink a database this call created, and its sidecars, by name in
    the checked directory."""
    for suffix in ("", "-wal", "-shm"):
        try:
            os.unlink(loc.name + suffix, dir_fd=loc.dir_fd)
        except OSError:
            pass


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


def _fresh_run_id(db: Database) -> str:
    """A run id whose random half no run of this store has: the kernel
    module's records carry only that half (a u32), and map back to their
    run by it (pyctl/evidence/anchors.py)."""
    host = hostid.host_part()
    while True:
        low = os.urandom(4).hex()  # what secrets.token_hex(4) does
        if low == "00000000":
            continue  # the module's own faults are run 0
        clash = db.conn.execute(
            "SELECT 1 FROM runs WHERE substr(run_id, -8) = ? LIMIT 1", [low]
        ).fetchone()
        if clash is None:
            return host + low


def new_run(
    db: Database,
    argv: Sequence[str],
    kind: str,
    *,
    mechanism: str = "",
    capabilities: dict[str, Any] | None = None,
    started: float | None = None,
) -> str:
    """Insert a run row and return its run id: the host part and 8 random
    hex digits (pyctl/evidence/hostid.py). started: the run's start (Unix
    time) when it began before this row (a trace attached first); else now."""
    run_id = _fresh_run_id(db)
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
                "started": time.time() if started is None else started,
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
# Records per multi-row insert: 48 * 18 values stay under the 999 bound
# variables an SQLite older than 3.32 allows a statement (a distribution's
# Python may link one); larger statements bought nothing more here.
# GPUFAULT_CALL_ROWS_PER_INSERT=1 is the one-record insert of before, for
# bench/bench_sustained.py's side-by-side runs.
CALL_ROWS_PER_INSERT = max(1, int(os.environ.get("GPUFAULT_CALL_ROWS_PER_INSERT", "48")))
_CALL_RECORDS_SQL = schema.call_insert_sql(CALL_ROWS_PER_INSERT)
_CALL_WIDTH = len(abi.CALL_SCALARS)


def insert_call_records(db: Database, run_id: str, records: list[tuple]) -> None:
    """Insert raw ring records (inside the caller's transaction), in order:
    CALL_ROWS_PER_INSERT records a statement, the rest one by one."""
    if not all(c in "0123456789abcdef" for c in run_id):
        raise ValueError("run ids are hex")
    k = CALL_ROWS_PER_INSERT
    full = len(records) // k * k if k > 1 else 0
    if full:
        # One flat list of every value, sliced into statements: C loops only.
        flat = list(itertools.chain.from_iterable(records[:full]))
        step = k * _CALL_WIDTH
        db.conn.executemany(
            _CALL_RECORDS_SQL.format(run=run_id),
            (flat[i : i + step] for i in range(0, len(flat), step)),
        )
    if full < len(records):
        db.conn.executemany(_CALL_RECORD_SQL.format(run=run_id), records[full:])
