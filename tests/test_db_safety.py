"""--db on a hostile machine: another local user (uid 65534, a real second
user: child processes run with setuid) owns a directory on the way, swaps
the database's name for a symlink, pre-creates the file or a sidecar, or
hands over a damaged or foreign file. Each is refused with one line, exit
2, before anything is attached or any thread seized, and the file is left
byte for byte as it was (pyctl/evidence/dbfile.py, store.open_db)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import evidence_rows
import pytest
from conftest import tag
from gftarget import REPO, TARGET, Target, on_victim

from pyctl.evidence import store

pytestmark = [pytest.mark.root]

if os.geteuid() != 0:  # pragma: no cover - the root tier
    pytest.skip("requires root (a second user, BPF, ptrace)", allow_module_level=True)
if not TARGET.exists():  # pragma: no cover - the Makefile builds it first
    pytest.skip("build/targets/gf_target missing: run make build", allow_module_level=True)

OTHER = 65534  # nobody: the other local user
GF = [sys.executable, "-m", "pyctl"]


def gf(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GF, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def refused(res: subprocess.CompletedProcess[str], *words: str) -> str:
    """Exit 2 and one line `gpufault: ...` holding every word; the line."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res
    assert len(lines) == 1 and lines[0].startswith("gpufault: "), res.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def become_other() -> None:
    """In a forked child: the other user, none of root's groups."""
    os.setgroups([])
    os.setgid(OTHER)
    os.setuid(OTHER)


def as_other(fn: Callable[[], None]) -> None:
    """fn run in a child that is the other user (forked, not exec-ed: the
    interpreter's own directory may be root's alone); fails if it failed."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            become_other()
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the other user's step failed"


def digest(p: Path) -> tuple[int, int, int, str]:
    """Owner, mode, links and the bytes' hash: 'left as it was'."""
    st = p.lstat()
    return st.st_uid, st.st_mode, st.st_nlink, hashlib.sha256(p.read_bytes()).hexdigest()


def sidecars(p: Path) -> list[str]:
    return sorted(s for s in ("-wal", "-shm", "-journal") if os.path.lexists(f"{p}{s}"))


@pytest.fixture
def public() -> Iterator[Path]:
    """A directory in /tmp that the other user can reach (pytest's
    tmp_path is root's 0700); each test sets its owner and mode."""
    d = Path(tempfile.mkdtemp(prefix=tag("db-"), dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


def gf_db(p: Path) -> None:
    """A real gpufault database with one run and its faults."""
    evidence_rows.fill(p)
    assert not sidecars(p)  # closed: checkpointed, -wal and -shm gone


def inject(pid: int, db: Path) -> list[str]:
    return [
        *on_victim("inject", pid),
        "-q",
        "--action",
        "fail",
        "--ret",
        "-5",
        "--every",
        "1",
        "--duration",
        "1s",
        "--db",
        str(db),
    ]


# ---- 1. the name swapped for a symlink while gpufault opens it -----------


def swapper(d: Path, victim: Path) -> tuple[int, int]:
    """The other user's loop, in a child: DIR/r.db is a file F, then a
    symlink to the victim, then F again, each by an atomic rename (F
    keeps a second name, so it comes back as the same inode and a check
    of the name after SQLite opened it sees F). Returns (pid, fd): the fd
    reads a byte once the loop runs."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            # Its own CPU, the opener on another: a race run truly side by
            # side (time-sliced on one CPU, each open saw one state only and
            # the old code passed 2,000 opens untouched; pinned, it turned
            # the victim into a database within a few hundred).
            os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
            become_other()
            os.chdir(d)
            open("f", "w").close()
            os.link("f", "r.db")
            os.write(w, b"r")
            while True:
                for step in (
                    lambda: os.symlink(victim, "l"),
                    lambda: os.rename("l", "r.db"),
                    lambda: os.link("f", "g"),
                    lambda: os.rename("g", "r.db"),
                ):
                    try:
                        step()
                    except OSError:
                        pass  # a name gpufault removed or made meanwhile
        finally:
            os._exit(1)
    os.close(w)
    return pid, r


def test_symlink_swap_race_never_reaches_the_victim(public: Path, tmp_path: Path) -> None:
    os.chown(public, OTHER, OTHER)  # the other user's directory, as in the report
    victim = tmp_path / "victim"  # a root file elsewhere: empty, so SQLite would take it
    victim.write_bytes(b"")
    os.chmod(victim, 0o644)
    before = digest(victim)
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs: the race is run side by side")
    pid, ready = swapper(public, victim)
    opened = 0
    reasons: set[str] = set()  # each refusal's text
    try:
        os.sched_setaffinity(0, {min(cpus)})
        assert os.read(ready, 1) == b"r"
        # The store's own open, as trace/inject/experiments call it: the
        # report needed ~30 CLI runs; 2,000 opens give the race far more.
        for _ in range(2000):
            try:
                store.open_db(public / "r.db").close()
                opened += 1
            except store.StoreError as e:
                reasons.add(str(e))
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # it raced the whole time
    finally:
        os.sched_setaffinity(0, cpus)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready)
    assert digest(victim) == before, "the victim became a database"
    assert not sidecars(victim)
    assert opened == 0, reasons
    assert all(r.startswith(f"{public}: owned by uid {OTHER}") for r in reasons), reasons


def test_a_directory_on_the_way_that_another_user_can_change(public: Path) -> None:
    """Not only the last directory: one above it that the other user owns
    (they could rename it and put a symlink in its place), one writable
    by others without the sticky bit, and a symlink of theirs."""
    mine = public / "mine"
    mine.mkdir(mode=0o755)
    os.chown(public, OTHER, OTHER)
    with pytest.raises(store.StoreError, match=f"{public}: owned by uid {OTHER}"):
        store.open_db(mine / "gf.db")
    os.chown(public, 0, 0)
    os.chmod(public, 0o777)  # world-writable, no sticky bit
    with pytest.raises(store.StoreError, match="writable by other users"):
        store.open_db(mine / "gf.db", readonly=True)
    os.chmod(public, 0o1777)  # a sticky /tmp: may be passed through, root's entries stay
    store.open_db(mine / "gf.db").close()
    as_other(lambda: os.symlink(mine, public / "link"))
    with pytest.raises(store.StoreError, match=f"symbolic link owned by uid {OTHER}"):
        store.open_db(public / "link" / "gf.db", readonly=True)
    os.symlink(mine, public / "rootlink")  # root's own link in root's place: followed
    store.open_db(public / "rootlink" / "gf.db", readonly=True).close()


def test_a_hard_link_is_not_the_database(tmp_path: Path) -> None:
    """A hard link would make a root file elsewhere the database (where
    fs.protected_hardlinks=0 lets anyone link a file they cannot write)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"")
    os.link(victim, tmp_path / "gf.db")
    before = digest(victim)
    with pytest.raises(store.StoreError, match="2 hard links"):
        store.open_db(tmp_path / "gf.db")
    assert digest(victim) == before and not sidecars(tmp_path / "gf.db")


# ---- 2. a file or sidecar another user made -------------------------------


def test_an_empty_db_the_other_user_made_in_tmp(target: Target, public: Path) -> None:
    """`su U -c ': > /tmp/x.db'` then inject: refused, the file stays as
    it was (U's, empty), no sidecar, the target untouched."""
    os.chmod(public, 0o1777)  # as /tmp
    db = public / "x.db"
    as_other(lambda: db.write_bytes(b""))
    before = digest(db)
    res = gf(*inject(target.pid, db))
    refused(res, str(db), "owned by uid 65534", "not root")
    assert digest(db) == before and not sidecars(db)
    assert [r[3] for r in target.victim(3)] == [2, 3, 4]  # no fault reached it
    # And a writer refuses a /tmp-like directory even when nothing is there
    # yet: the -wal/-shm SQLite makes by name could be planted first.
    db.unlink()
    res = gf(*inject(target.pid, db))
    refused(res, str(public), "other users can create files there")
    assert not list(public.iterdir())


@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal"])
def test_a_sidecar_the_other_user_made(
    target: Target, public: Path, tmp_path: Path, suffix: str
) -> None:
    """Root's own database in a sticky directory (made by an older
    gpufault: moved there), a sidecar the other user planted beside it:
    every reader and writer refuses, nothing changes."""
    os.chmod(public, 0o1777)
    db = public / "x.db"
    gf_db(tmp_path / "x.db")
    os.rename(tmp_path / "x.db", db)
    side = Path(f"{db}{suffix}")
    as_other(lambda: side.write_bytes(b""))
    before, side_before = digest(db), digest(side)
    for args in (["faults"], ["show", "last"], inject(target.pid, db)):
        refused(gf(*args, "--db", str(db)), f"{side}: owned by uid 65534")
    assert digest(db) == before and digest(side) == side_before
    assert sidecars(db) == [suffix]


def test_a_readers_database_owned_by_another_user(tmp_path: Path) -> None:
    """faults/show read a file of the other user's: refused (whoever owns
    it reads every fault and the target's argv), and not modified."""
    db = tmp_path / "x.db"
    gf_db(db)
    os.chown(db, OTHER, OTHER)
    before = digest(db)
    for args in (["faults"], ["show", "last"]):
        refused(gf(*args, "--db", str(db)), str(db), "owned by uid 65534")
    assert digest(db) == before and not sidecars(db)


# ---- 8. damaged or foreign: refused read-only, before anything is armed -----


def strace_gf(args: list[str], log: Path) -> subprocess.CompletedProcess[str]:
    """gpufault under strace: which bpf/perf_event_open/ptrace calls it made."""
    if shutil.which("strace") is None:
        pytest.skip("requires strace (tools/setup-deps.sh installs it)")
    return subprocess.run(
        ["strace", "-f", "-qq", "-o", str(log), "-e", "trace=bpf,perf_event_open,ptrace", *GF]
        + args,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def nothing_armed(log: Path) -> None:
    """No program attached (a link or a perf-event uprobe) and no thread
    seized: what the strace log of the run holds."""
    text = log.read_text()
    for call in ("BPF_LINK_CREATE", "perf_event_open(", "PTRACE_SEIZE", "PTRACE_ATTACH"):
        assert call not in text, call


def damage(db: Path, *tables: str) -> None:
    """Overwrite the root pages of `tables` (the page header and cell
    pointers) with junk: sqlite_master still reads, the tables do not."""
    con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)  # no -wal/-shm
    pages = [
        con.execute("SELECT rootpage FROM sqlite_master WHERE name=?", (t,)).fetchone()[0]
        for t in tables
    ]
    size = con.execute("PRAGMA page_size").fetchone()[0]
    con.close()
    with open(db, "r+b") as f:
        for page in pages:
            f.seek((page - 1) * size)
            f.write(b"\xee" * 64)


def test_a_damaged_database_is_refused_before_arming(target: Target, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    gf_db(db)
    damage(db, "runs", "faults")
    before = digest(db)
    res = strace_gf(inject(target.pid, db), tmp_path / "strace.log")
    nothing_armed(tmp_path / "strace.log")
    assert digest(db) == before and not sidecars(db)  # no `refused` row, no WAL
    refused(res, str(db), "restore it from a copy")
    assert [r[3] for r in target.victim(3)] == [2, 3, 4]


def test_show_last_on_a_damaged_database_is_one_line(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    gf_db(db)
    damage(db, "faults")
    before = digest(db)
    for args in (["show", "last"], ["faults"]):
        res = gf(*args, "--db", str(db))
        refused(res, str(db), "malformed")
        assert "Traceback" not in res.stderr and "internal error" not in res.stderr
    assert digest(db) == before and not sidecars(db)


def _every_reader(db: Path, run: str, out: Path) -> dict[str, list[str]]:
    """Each command that reads the store, with what it reads: faults, the
    chains, the timeline (a run, an experiment), the calls summary, the
    experiments and their report."""
    return {
        "faults": ["faults"],
        "show last": ["show", "last"],
        "show RUN": ["show", run],
        "timeline": ["timeline"],
        "timeline EXP": ["timeline", "e1"],
        "calls last": ["calls", "last"],
        "calls RUN": ["calls", run],
        "experiment results": ["experiment", "results"],
        "experiment results EXP": ["experiment", "results", "e1"],
        "experiment report": ["experiment", "report", "e1", "-o", str(out)],
    }


def test_every_reader_of_a_damaged_database_says_so_in_one_line(tmp_path: Path) -> None:
    """Issue 25 item 8: a damaged page met while reading is the file's
    fault. `show`/`faults` said so in one line (exit 2); timeline, calls,
    experiment results and experiment report exited 70 with an internal
    error. Each reader first runs on the sound file (it reads these
    tables), then on the damaged one: the same line as `show`, the file
    untouched, no report written."""
    import observe_db

    db = tmp_path / "gf.db"
    run = evidence_rows.fill(db)["run"]
    d = observe_db.make_db(db)
    observe_db.add_experiment(d, "e1", name="tokenizer-stall", run_id="5e6f7a8b")
    d.close()
    out = tmp_path / "report.html"
    readers = _every_reader(db, run, out)
    for what, args in readers.items():
        res = gf(*args, "--db", str(db))
        assert res.returncode == 0, (what, res.stderr)
    out.unlink()
    con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    con.close()
    damage(db, *tables)
    before = digest(db)
    line = refused(gf("show", "last", "--db", str(db)), str(db), "malformed")
    for what, args in readers.items():
        res = gf(*args, "--db", str(db))
        assert res.returncode == 2 and res.stderr.strip() == line, (what, res.stderr)
        assert res.stdout == "", (what, res.stdout)
    assert digest(db) == before and not sidecars(db) and not out.exists()


FOREIGN = {
    # An older version's number on someone else's runs table: migrating it
    # would drop their column (ensure_schema refused it only after chmod
    # and the switch to WAL).
    "schema 1": "CREATE TABLE runs (x TEXT); INSERT INTO runs VALUES ('theirs'); "
    "PRAGMA user_version=1;",
    # The current number on a runs table of another shape: nothing refused
    # it, the missing tables were added and the run's insert failed after
    # the probes were attached.
    "schema 2": "CREATE TABLE runs (run_id TEXT PRIMARY KEY, note TEXT); PRAGMA user_version=2;",
}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_a_foreign_database_is_refused_untouched(target: Target, tmp_path: Path, kind: str) -> None:
    db = tmp_path / "other.db"
    con = sqlite3.connect(db)
    con.executescript(FOREIGN[kind])
    con.close()
    os.chmod(db, 0o644)
    before = digest(db)
    res = strace_gf(inject(target.pid, db), tmp_path / "strace.log")
    nothing_armed(tmp_path / "strace.log")
    assert digest(db) == before and not sidecars(db)  # mode 0644 kept, not WAL
    refused(res, str(db), "pass another --db")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    assert con.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    con.close()
    assert [r[3] for r in target.victim(3)] == [2, 3, 4]


def _pages_read(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each later open's `pages` (True: it read every page, quick_check)."""
    seen: list[bool] = []
    check = store._validate

    def spy(loc: Any, p: Path, *, pages: bool = True) -> None:
        seen.append(pages)
        check(loc, p, pages=pages)

    monkeypatch.setattr(store, "_validate", spy)
    return seen


def test_the_full_read_is_skipped_only_for_the_file_as_last_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """quick_check costs seconds on a large store: a file exactly as a
    writer last closed it (size, mtime, ctime) was read whole already.
    A write in between, by anyone, moves its ctime: read whole again."""
    seen = _pages_read(monkeypatch)
    db = tmp_path / "gf.db"
    gf_db(db)  # made and closed by store.open_db: noted as whole
    store.open_db(db).close()
    store.open_db(db).close()
    assert seen == [False, False]
    with open(db, "r+b") as f:  # the same bytes written back: same size, new mtime/ctime
        head = f.read(100)
        f.seek(0)
        f.write(head)
    store.open_db(db).close()
    assert seen == [False, False, True]
    monkeypatch.setenv("GPUFAULT_CACHE_DIR", "")  # no cache: always whole
    store.open_db(db).close()
    assert seen[-1] is True


def test_a_reader_left_open_keeps_the_file_known_whole_until_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script or Datasette that opened the store after gpufault closed
    it, and stays open, leaves an empty -wal: the file is still all there
    is, so the next run does not read every page (bench_attach's reader
    made every trace start pay a quick_check of the whole store). Once
    the reader writes, its frames are in the -wal: read whole."""
    seen = _pages_read(monkeypatch)
    db = tmp_path / "gf.db"
    gf_db(db)
    reader = sqlite3.connect(db)
    try:
        reader.execute("SELECT count(*) FROM runs").fetchone()
        wal = Path(f"{db}-wal")
        assert wal.exists() and wal.stat().st_size == 0
        store.open_db(db).close()
        assert seen == [False]
        reader.execute("INSERT INTO runs (run_id, status) VALUES ('theirs', 'x')")
        reader.commit()
        assert wal.stat().st_size > 0
        store.open_db(db).close()
        assert seen == [False, True]
    finally:
        reader.close()
