"""Best-effort output for a controller: a line never blocks or ends a run.

A run's stderr may be a pipe whose reader exited (`2>&1 | head -3`), a
closed descriptor (`2>&-`), or a pipe nobody reads (`| sleep 20`, a
terminal paused with Ctrl-S). Written directly, the first raised
BrokenPipeError inside the fire ingest (the batch's rows rolled back: the
store kept 0 faults), the second ended the controller at its first line,
the third blocked the loop in write(2) with every probe still attached
past --duration. So while a run lasts, stderr is a Channel: lines go into
a bounded queue that a daemon thread writes out; a line that finds the
queue full, or a descriptor that failed (EPIPE, EBADF, EIO), is dropped
and counted. The evidence, the deadline and the run's final state never
wait on it.

No O_NONBLOCK on the descriptor: the flag belongs to the open file, which
the target of `-- CMD` shares as its own stderr; it would get EAGAIN.
SIGPIPE: Python ignores it (a write returns EPIPE instead), and
`pyctl.stdfds.fill_std_fds` makes sure of it for the controller; the `-- CMD` child
gets the default back (subprocess's restore_signals).
"""

from __future__ import annotations

import atexit
import errno
import io
import os
import select
import sys
import threading
from collections import deque
from typing import Any, TextIO

# Lines held for a slow reader: a few seconds of rate-limited fire lines
# (pyctl/cli/launch.py), ~100 KiB at most; past it lines are dropped.
MAX_QUEUED = 1024
# How long the end of a run waits for what is queued to reach a slow reader.
SETTLE_S = 1.0

_DEAD_ERRNOS = (errno.EPIPE, errno.EBADF, errno.EIO, errno.EINVAL, errno.ENOSPC)


class Channel:
    """Chunks of bytes for one descriptor, written in order by a daemon thread."""

    def __init__(self, fd: int, max_queued: int = MAX_QUEUED) -> None:
        self.fd = fd
        self.max_queued = max_queued
        self.dropped = 0  # chunks (lines) never written
        self.dead = False  # the descriptor failed: nothing is written any more
        self._q: deque[bytes] = deque()
        self._busy = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def put(self, data: bytes) -> None:
        """Queue data; never blocks (beyond a short lock), never raises."""
        if not data:
            return
        with self._cv:
            if self.dead or len(self._q) >= self.max_queued:
                self.dropped += 1
                return
            self._q.append(data)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"gpufault-out-{self.fd}", daemon=True
                )
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q:
                    self._cv.wait()
                data = self._q.popleft()
                self._busy = True
            ok = self._write(data)
            with self._cv:
                self._busy = False
                if not ok:
                    self.dead = True
                    self.dropped += 1 + len(self._q)
                    self._q.clear()
                self._cv.notify_all()
            if not ok:
                return

    def _write(self, data: bytes) -> bool:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in _DEAD_ERRNOS:
                    return False
                if e.errno == errno.EAGAIN:
                    # Someone else set O_NONBLOCK on the open file: wait for room.
                    select.select([], [self.fd], [], 1.0)
                    continue
                return False
            view = view[n:]
        return True

    def flush(self, timeout: float) -> bool:
        """Wait up to timeout for the queue to reach the descriptor; True when
        it did (or the descriptor failed: nothing is left to wait for)."""
        with self._cv:
            return self._cv.wait_for(lambda: self.dead or not (self._q or self._busy), timeout)


class _ChannelRaw(io.RawIOBase):
    """What a TextIOWrapper writes into: the channel, at once, in full."""

    def __init__(self, chan: Channel) -> None:
        self.chan = chan

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.chan.put(data)
        return len(data)

    def fileno(self) -> int:
        return self.chan.fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self.chan.fd)
        except OSError:
            return False


def text_stream(chan: Channel, like: TextIO | None = None) -> TextIO:
    """A text stream (as sys.stderr is) whose writes go into chan."""
    enc = getattr(like, "encoding", None) or "utf-8"
    return io.TextIOWrapper(
        _ChannelRaw(chan),  # type: ignore[arg-type,type-var]
        encoding=enc,
        errors="backslashreplace",
        line_buffering=True,
        write_through=True,
    )


class _Installed:
    chan: Channel | None = None
    stream: TextIO | None = None
    saved: TextIO | None = None


def install_stderr() -> Channel | None:
    """Make sys.stderr a Channel on its descriptor for the run (click.echo,
    print and the status line all write through it). Not when sys.stderr
    has no descriptor (a test's CliRunner captures into memory, which
    never blocks) or is a Channel already. Returns the channel."""
    cur = sys.stderr
    if _Installed.stream is not None and cur is _Installed.stream:
        return _Installed.chan
    try:
        fd = cur.fileno()  # type: ignore[union-attr]
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None
    try:
        cur.flush()  # type: ignore[union-attr]
    except (OSError, ValueError):
        pass
    chan = Channel(fd)
    _Installed.chan, _Installed.saved = chan, cur
    _Installed.stream = sys.stderr = text_stream(chan, cur)

    # A line queued after settle_stderr left the channel in place (the
    # command's last error line) gets a short last chance at exit.
    atexit.register(chan.flush, SETTLE_S / 2)
    return chan


def settle_stderr(timeout: float = SETTLE_S) -> int:
    """At the end of a run: wait up to timeout for queued lines, then put the
    original sys.stderr back, unless its reader is stuck (the channel did
    not drain): then the channel stays, so a later line is dropped rather
    than block the exit. Returns the lines dropped."""
    chan = _Installed.chan
    if chan is None:
        return 0
    drained = chan.flush(timeout)
    if drained and not chan.dead and sys.stderr is _Installed.stream:
        sys.stderr = _Installed.saved  # type: ignore[assignment]
        _Installed.chan = _Installed.stream = _Installed.saved = None
    return chan.dropped


def echo(line: str) -> None:
    """One line on stderr, best effort: a failed write (closed, broken pipe)
    is dropped, never raised into the caller's loop."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):
        pass
