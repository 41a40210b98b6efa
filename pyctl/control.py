"""How `gpufault release` reaches running controllers: a Unix socket per
controller, never a signal sent to a PID read from a file.

A PID in a pidfile goes stale when its controller is SIGKILLed (the next
process with that PID, an unrelated `sleep` once, got the signal), and a
controller in a PID namespace knows only its namespace PID (`2.run` named
kthreadd on the host). A socket has neither problem: a dead controller's
socket refuses connections (release removes it), and SO_PEERCRED gives the
peer's PID as the *caller's* namespace sees it, so `release --pid N`
matches the PID the user sees.

The controller's listener thread does no ptrace itself (only the thread
that seized the target may): it forwards each request as SIGUSR1 to the
main thread, which already releases stalls on that signal.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from pyctl import rundir

SUFFIX = ".sock"


class ControlError(Exception):
    """One line for the user."""


def peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end (SO_PEERCRED), as this
    process's PID namespace sees it; `gpufault serve` checks it too."""
    return rundir.peer_cred(conn)


class ControlSocket:
    """The controller's end: listen until close(); each `release` request
    from root becomes SIGUSR1 to the thread that created this object."""

    def __init__(self, run_id: str, run_dir: Path | None = None) -> None:
        # Read when used (an empty GPUFAULT_RUN_DIR means the default).
        self.run_dir = run_dir or Path(rundir.path())
        self.path = self.run_dir / f"{os.getpid()}-{run_id}{SUFFIX}"
        self.run_id = run_id
        self._main = threading.get_ident()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        # Checked, or made 0700; never chmod-ed (pyctl/rundir.py). Unsafe:
        # an OSError, which the runner turns into its one warning line.
        os.close(rundir.open_dir(str(self.run_dir), create=True, owner=os.geteuid()))
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.bind(str(self.path))
            os.chmod(self.path, 0o600)
            s.listen(4)
        except OSError:
            s.close()
            raise
        self._sock = s
        self._thread = threading.Thread(target=self._serve, name="gf-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        s = self._sock
        while s is not None:
            try:
                conn, _ = s.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(2.0)
                    _pid, uid = peer(conn)
                    req = conn.recv(64).strip()
                    if uid != 0 or req != b"release":
                        conn.sendall(b"refused\n")
                        continue
                    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
                        # Not in its loop yet (or done): SIGUSR1 would kill it.
                        conn.sendall(b"busy\n")
                        continue
                    signal.pthread_kill(self._main, signal.SIGUSR1)
                    conn.sendall(f"ok {self.run_id}\n".encode())
                except OSError:
                    continue

    def close(self) -> None:
        s, self._sock = self._sock, None
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        try:
            self.path.unlink()
        except OSError:
            pass


@dataclass
class Released:
    pid: int  # the controller, as this process's PID namespace sees it
    run_id: str


@dataclass
class Outcome:
    released: list[Released]
    stale: int  # sockets of dead controllers, removed
    untrusted: list[tuple[str, int]]  # (socket name, listener's uid): sent nothing


def release(pid: int | None = None, run_dir: Path | None = None) -> Outcome:
    """Ask every live controller (or the one with this PID) to release its
    stalled threads.

    The run directory is checked as the resident client checks it (root's
    alone, by descriptor: pyctl/rundir.py), and each socket is reached
    through that descriptor with rundir.connect_root: a listener that is
    not root gets no byte (it is reported in `untrusted`). Raises
    ControlError (one line) for a directory that is not root's alone or
    cannot be read."""

    d = str(run_dir or rundir.path())
    try:
        fd = rundir.open_dir(d, create=False, owner=0)
    except FileNotFoundError:
        return Outcome([], 0, [])
    except rundir.UnsafeRunDir as e:
        raise ControlError(f"{e.what}: not asking anything there") from None
    try:
        try:
            # The O_PATH descriptor cannot be listed: open it for reading
            # through itself (the checked inode, not the name again).
            lfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        except PermissionError:
            raise ControlError(f"cannot read {d}: run as root") from None
        try:
            entries = sorted(n for n in os.listdir(lfd) if n.endswith(SUFFIX))
        finally:
            os.close(lfd)
        return _ask_each(fd, d, entries, pid)
    finally:
        os.close(fd)


def _ask_each(fd: int, d: str, entries: list[str], pid: int | None) -> Outcome:
    out = Outcome([], 0, [])
    for name in entries:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        with c:
            try:
                peer_pid, _uid = rundir.connect_root(c, fd, name, timeout_s=2.0)
            except (ConnectionRefusedError, FileNotFoundError):
                try:
                    os.unlink(name, dir_fd=fd)  # its controller died (SIGKILL)
                    out.stale += 1
                except FileNotFoundError:
                    pass
                continue
            except rundir.UntrustedPeer as e:
                out.untrusted.append((name, e.uid))
                continue
            except PermissionError:
                raise ControlError(f"cannot connect to {d}/{name}: run as root") from None
            except OSError:  # a full backlog (BlockingIOError), not a socket
                continue
            if pid is not None and peer_pid != pid:
                continue
            try:
                c.settimeout(2.0)
                c.sendall(b"release\n")
                answer = c.recv(128).decode(errors="replace").split()
            except OSError:
                continue
            if answer[:1] == ["ok"]:
                out.released.append(Released(peer_pid, answer[1] if len(answer) > 1 else ""))
    return out
