"""Every native frame the suite's tests stored lies in an executable mapping
(issue 22): one assertion over every `stacks` row of every gpufault
evidence database under the session's basetemp, run once when the
session ends (tests/conftest.py's pytest_sessionfinish and
pytest_terminal_summary call check_tree and verdict).

A frame is good when it has a module and an offset (no bare address), its
method is one the unwinder writes (docs/schema.md, stacks.method), and,
where the module file is still there with the build-id the row names, the
offset lies in one of that file's executable PT_LOAD segments (read with
pyctl/elf.py, the project's one ELF reader). A file that is gone, or was
rebuilt since (another build-id), cannot say where its code was: such a
frame is checked for its shape only, and counted as such.

Databases are read without writing next to them: a file with no -wal is
opened `immutable=1` (no lock, no -shm); one with a -wal is copied with
its -wal into a private directory first, so the frames still in the WAL
are read too. Files that are not gpufault databases (no runs, faults and
stacks tables) are skipped; a gpufault database a test damaged on
purpose is counted as unreadable, not checked.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pyctl import elf

# stacks.method as pyctl/symbols/frames.py writes it (docs/schema.md).
METHODS = frozenset({"ip", "cfi", "fp", "caller"})
PF_X = 1  # p_flags: the segment is executable
_SQLITE = b"SQLite format 3\x00"
_TABLES = {"runs", "faults", "stacks"}

# GPUFAULT_FRAMES_CHECK (see verdict): auto (unset) fails on a bad frame
# the unwinder wrote, warns on a planted or pre-schema-3 one, and fails on
# zero frames once a test that stores stacks under its tmp_path passed
# (STACK_TESTS); require fails on any bad frame and on zero frames; warn
# only warns; off does not check.
ENV = "GPUFAULT_FRAMES_CHECK"
MODES = ("auto", "require", "warn", "off")

# Tests that store native frames in a database under their tmp_path when
# they pass (root, BPF): if one of them passed and the check found no
# frame, the check looked in the wrong place. Node ids without parameters.
STACK_TESTS = frozenset(
    {
        "tests/test_unwind.py::test_unwound_frames_equal_perfs",
        "tests/test_unwind.py::test_cxx_killed_by_sigabrt_keeps_every_module",
        "tests/test_unwind.py::test_rust_wheel_frames_equal_perfs",
        "tests/test_pystack.py::test_frames_equal_py_spys_while_held",
        "tests/test_engine.py::test_fail_returns_injected_value",
    }
)


@dataclass(frozen=True)
class BadFrame:
    db: str  # relative to the tree checked
    fault_id: str
    depth: int
    address: int
    symbol: str | None
    module: str | None
    offset: int | None
    method: str | None
    why: str

    def line(self) -> str:
        addr = self.address & (1 << 64) - 1 if self.address is not None else 0
        off = f"{self.offset:#x}" if self.offset is not None else None
        return (
            f"{self.db} {self.fault_id} #{self.depth} {addr:#x} {self.symbol!r} "
            f"module={self.module} offset={off} method={self.method}: {self.why}"
        )


@dataclass
class Report:
    dbs: int = 0  # gpufault databases read
    frames: int = 0  # stacks rows checked
    in_segment: int = 0  # of them, checked against the module's segments
    shape_only: int = 0  # module gone, rebuilt, or not a file ([vdso])
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (db, why)
    bad: list[BadFrame] = field(default_factory=list)

    def summary(self) -> str:
        s = (
            f"frames check: {self.frames} native frames in {self.dbs} gpufault databases"
            f" ({self.in_segment} inside their module's executable PT_LOAD,"
            f" {self.shape_only} module and offset only: file gone or rebuilt)"
        )
        if self.unreadable:
            s += f", {len(self.unreadable)} unreadable databases skipped"
        return s + f", {len(self.bad)} bad"


class _Segments:
    """Each module file's executable segments as (lo, hi) virtual
    addresses and its build-id, read once per path."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple[str, int, list[tuple[int, int]]] | None] = {}

    def get(self, path: str) -> tuple[str, int, list[tuple[int, int]]] | None:
        """(build-id, first_load, executable ranges), or None: no such
        regular file, or not an ELF file."""
        if path not in self._memo:
            try:
                with elf.ElfFile.open(path) as f:
                    ranges = [(s.vaddr, s.vaddr + s.memsz) for s in f.loads if s.flags & PF_X]
                    self._memo[path] = (f.build_id, f.first_load, ranges)
            except (OSError, elf.ElfError):
                self._memo[path] = None
        return self._memo[path]


def sqlite_files(root: Path) -> Iterator[Path]:
    """Regular files under root that start with SQLite's header (no links
    followed: a test may plant one)."""
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(("-wal", "-shm", "-journal")):
                continue
            p = Path(d) / name
            try:
                if p.is_symlink() or not p.is_file():
                    continue
                with open(p, "rb") as f:
                    head = f.read(16)
            except OSError:
                continue
            if head == _SQLITE:
                yield p


def _connect(path: Path, scratch: Path) -> sqlite3.Connection:
    """A read-only connection that creates nothing next to path."""
    wal = Path(f"{path}-wal")
    if wal.exists():
        # Committed frames may still be in the WAL, which only a writable
        # connection (-shm) reads: read a private copy of both.
        d = Path(tempfile.mkdtemp(dir=scratch))
        shutil.copyfile(path, d / "db")
        shutil.copyfile(wal, d / "db-wal")
        return sqlite3.connect(d / "db")
    return sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro&immutable=1", uri=True)


def check_db(path: Path, rel: str, report: Report, segs: _Segments, scratch: Path) -> None:
    """Check one file's frames into report (nothing if it is not a
    gpufault database)."""
    try:
        c = _connect(path, scratch)
    except (OSError, sqlite3.Error) as e:
        report.unreadable.append((rel, str(e)))
        return
    try:
        try:
            tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.Error as e:
            report.unreadable.append((rel, str(e)))
            return
        if not _TABLES <= tables:
            return
        cols = {r[1] for r in c.execute("PRAGMA table_info(stacks)")}
        want = ("fault_id", "depth", "address", "symbol", "module", "offset", "build_id", "method")
        sel = ", ".join(w if w in cols else "NULL" for w in want)
        try:
            rows = c.execute(f"SELECT {sel} FROM stacks ORDER BY fault_id, depth").fetchall()
        except sqlite3.Error as e:
            report.unreadable.append((rel, str(e)))
            return
    finally:
        c.close()
    report.dbs += 1
    for fid, depth, addr, sym, module, off, bid, method in rows:
        report.frames += 1
        why = _frame_fault(module, off, bid, method, depth, segs, report)
        if why:
            report.bad.append(BadFrame(rel, fid, depth, addr, sym, module, off, method, why))


def _frame_fault(
    module: str | None,
    off: int | None,
    bid: str | None,
    method: str | None,
    depth: int,
    segs: _Segments,
    report: Report,
) -> str:
    """Why the frame is bad, '' if it is not."""
    if not module or off is None:
        return "no module and offset (a bare address)"
    if method not in METHODS:
        return f"method {method!r} is none of {', '.join(sorted(METHODS))}"
    if off < 0:
        return "negative offset"
    info = segs.get(module) if module.startswith("/") else None
    if info is None or (info[0] or None) != (bid or None):
        report.shape_only += 1
        return ""
    _bid, first_load, ranges = info
    vaddr = first_load + off
    # A return address may be one past its segment's end (a call that
    # does not return as the code's last instruction); the probed ip not.
    if any(lo <= vaddr < hi or (method != "ip" and vaddr == hi) for lo, hi in ranges):
        report.in_segment += 1
        return ""
    rs = " ".join(f"{lo:#x}-{hi:#x}" for lo, hi in ranges) or "none"
    return f"vaddr {vaddr:#x} is in no executable PT_LOAD of the module ({rs})"


def check_tree(root: Path) -> Report:
    """Check every gpufault database under root."""
    report = Report()
    segs = _Segments()
    scratch = Path(tempfile.mkdtemp(prefix="gf-frames-check-"))
    try:
        for p in sqlite_files(root):
            check_db(p, str(p.relative_to(root)), report, segs, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return report


def mode() -> str:
    """GPUFAULT_FRAMES_CHECK, or ValueError naming the known ones."""
    m = os.environ.get(ENV, "") or "auto"
    if m not in MODES:
        raise ValueError(f"{ENV}={m!r}: expected one of {', '.join(MODES)}")
    return m


def verdict(report: Report, how: str, stack_tests_passed: bool) -> tuple[bool, list[str]]:
    """(failed, lines for the terminal summary). how: a MODES value.

    The one writer of stacks rows (pyctl/engine/evidence.py, from
    frames.StoredFrame) always sets a method; a row without one is older
    than schema 3 or was planted by a test (tests/evidence_rows.py,
    tests/observe_db.py plant module-less frames). Under auto a bad frame
    with a method fails the session and one without is a warning line;
    require fails on either, warn on neither."""
    lines = [report.summary()]
    written = [b for b in report.bad if b.method is not None]
    fatal = {"auto": written, "require": report.bad, "warn": []}[how]
    failed = bool(fatal)
    if fatal:
        lines.append(f"frames check FAILED: {len(fatal)} frames outside an executable mapping:")
        lines.extend("  " + b.line() for b in fatal[:200])
        if len(fatal) > 200:
            lines.append(f"  ... and {len(fatal) - 200} more")
    ids = {id(b) for b in fatal}
    rest = [b for b in report.bad if id(b) not in ids]
    if rest:
        per_db: dict[str, list[BadFrame]] = {}
        for b in rest:
            per_db.setdefault(b.db, []).append(b)
        what = "without a method (planted by a test, or older than schema 3)"
        if how == "warn":
            what = f"({ENV}=warn)"
        lines.append(
            f"frames check WARNING: {len(rest)} bad frames {what} in {len(per_db)} databases,"
            " not failing the session:"
        )
        for bs in per_db.values():
            lines.append(f"  {len(bs)} like {bs[0].line()}")
    if report.frames == 0 and (how == "require" or (how == "auto" and stack_tests_passed)):
        why = f"{ENV}=require" if how == "require" else "a test that stores stacks passed"
        lines.append(f"frames check FAILED: no frame checked, yet {why}: the check looked in vain")
        failed = True
    return failed, lines


class Plugin:
    """The session's check, registered by tests/conftest.py: once, in the
    process that owns the basetemp (xdist's controller, whose basetemp
    holds the workers'), after every test."""

    def __init__(self) -> None:
        self.stack_tests_passed = False
        self.lines: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.passed:
            if report.nodeid.split("[", 1)[0] in STACK_TESTS:
                self.stack_tests_passed = True

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config = session.config
        if hasattr(config, "workerinput"):
            return  # a worker: its controller checks the whole tree
        try:
            how = mode()
        except ValueError as e:
            self.lines = [f"frames check FAILED: {e}"]
            session.exitstatus = pytest.ExitCode.USAGE_ERROR
            return
        if how == "off":
            self.lines = [f"frames check: off ({ENV}=off)"]
            return
        factory = getattr(config, "_tmp_path_factory", None)
        if factory is None:
            return
        report = check_tree(factory.getbasetemp())
        failed, self.lines = verdict(report, how, self.stack_tests_passed)
        if failed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for line in self.lines:
            red = "FAILED" in line
            yellow = "WARNING" in line
            terminalreporter.write_line(line, red=red, yellow=yellow and not red)
