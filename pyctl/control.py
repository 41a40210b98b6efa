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
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

RUN_DIR = Path(os.environ.get("GPUFAULT_RUN_DIR", "/run/gpufault"))
SUFFIX = ".sock"
_CRED = struct.Struct("=iII")  # struct ucred: pid, uid, gid


class ControlError(Exception):
    """One line for the user."""


def peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end (SO_PEERCRED), as this
    process's PID namespace sees it; `gpufault serve` checks it too."""
    pid, uid, _gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _CRED.size))
    return pid, uid


class ControlSocket:
    """The controller's end: listen until close(); each `release` request
    from root becomes SIGUSR1 to the thread that created this object."""

    def __init__(self, run_id: str, run_dir: Path | None = None) -> None:
        self.run_dir = run_dir or RUN_DIR
        self.path = self.run_dir / f"{os.getpid()}-{run_id}{SUFFIX}"
        self.run_id = run_id
        self._main = threading.get_ident()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from pyctl import rundir

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


def release(pid: int | None = None, run_dir: Path | None = None) -> tuple[list[Released], int]:
    """Ask every live controller (or the one with this PID) to release its
    stalled threads. Returns (who answered, stale sockets removed)."""
    d = run_dir or RUN_DIR
    try:
        entries = sorted(d.glob(f"*{SUFFIX}"))
    except PermissionError:
        raise ControlError(f"cannot read {d}: run as root") from None
    if not d.exists():
        return [], 0
    if not os.access(d, os.R_OK | os.X_OK):
        raise ControlError(f"cannot read {d}: run as root")
    done: list[Released] = []
    stale = 0
    for path in entries:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        c.settimeout(2.0)
        try:
            c.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            c.close()
            path.unlink(missing_ok=True)  # its controller died (SIGKILL)
            stale += 1
            continue
        except PermissionError:
            c.close()
            raise ControlError(f"cannot connect to {path}: run as root") from None
        with c:
            peer_pid, _uid = peer(c)
            if pid is not None and peer_pid != pid:
                continue
            try:
                c.sendall(b"release\n")
                answer = c.recv(128).decode(errors="replace").split()
            except OSError:
                continue
            if answer[:1] == ["ok"]:
                done.append(Released(peer_pid, answer[1] if len(answer) > 1 else ""))
    return done, stale
