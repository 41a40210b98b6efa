"""The `gpufault` side of `gpufault serve`: hand `trace --pid`/`inject
--pid` to a running server, or say that it could not (None), in which
case the entry runs the command itself as if no server existed.

What the user sees is the same either way: the controller writes to this
process's own stdin, stdout and stderr (passed as descriptors), runs in
this cwd with this environment and umask, ends on the signals this
process gets (forwarded), and its exit status is this process's. Killing
this process (even SIGKILL) ends the controller: it watches the socket
and kills itself when it closes, which detaches everything as killing an
in-process controller does (pyctl/resident/server.py).
"""

from __future__ import annotations

# The C modules under socket and signal, whose Python wrappers add enum
# classes this needs none of: with array, ~15 ms of a ~85 ms served
# start-up from a clean venv on the 2-vCPU VM. The calls are the same.
import _signal as signal
import _socket as socket
import os
import sys

from pyctl import rundir
from pyctl.resident import wire

# A served run lost its controller without a status (it was killed).
EXIT_LOST = 70
# The server answers within milliseconds (it forks; the controller says
# "served"); past this the client runs the command itself. A controller
# forked just after that finds the socket closed and ends unseen. The
# same bound holds for connect(): a server whose backlog is full (stuck,
# or flooded by another user's connects) is skipped after it.
ANSWER_S = 10.0


class _Refused(Exception):
    """Not handing over, for a reason worth one line to the user."""


def _connect(s: socket.socket) -> None:
    """Connect to the server's socket, or raise: OSError when none can be
    reached (silent: the common case), _Refused when one is there but is
    not to be trusted with this process's descriptors and environment.

    Checked before a byte is sent: the run directory (root's alone, by
    descriptor: pyctl/rundir.py), the connect bounded by ANSWER_S, and the
    listening process's credentials (SO_PEERCRED uid 0), which no file
    mode, link or rename in the directory can fake."""
    try:
        fd = rundir.open_dir(create=False, owner=0)
    except rundir.UnsafeRunDir as e:
        raise _Refused(f"{e.what}: not handing over to gpufault serve") from None
    try:
        rundir.connect_root(s, fd, wire.SOCKET_NAME, timeout_s=ANSWER_S)
    except BlockingIOError:
        raise _Refused(
            f"gpufault serve ({wire.socket_path()}) did not accept within {ANSWER_S:.0f} s"
        ) from None
    except rundir.UntrustedPeer as e:
        raise _Refused(
            f"{wire.socket_path()} is served by uid {e.uid}, not root: not handing over "
            "(stop that process; check who can write the run directory)"
        ) from None
    finally:
        os.close(fd)


def _await_hello(s: socket.socket) -> None:
    """Wait, at most ANSWER_S, for the byte the server sends once it has
    accepted this connection. Nothing is sent before it: a hung server
    (its listener alive, its accept loop not) would otherwise hold this
    process's stdin, stdout and stderr in its queue for as long as it
    lives (the caller's reader of stderr never sees its end), and could
    run the command late, after it ran here. Raises TimeoutError."""
    s.settimeout(ANSWER_S)
    if s.recv(1) != wire.HELLO:
        raise ConnectionError("not gpufault serve's greeting")
    s.settimeout(None)


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def try_serve(argv: list[str]) -> int | None:
    """The command's exit status when a server ran it; None when there is
    no server, it refused, or this process cannot hand over."""
    if os.environ.get("GPUFAULT_NO_SERVER"):
        return None
    if any(a == "--ready-fd" or a.startswith("--ready-fd=") for a in argv):
        # Only stdin, stdout and stderr are handed over: descriptor N is
        # this process's, so the run stays here.
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        return _hand_over(s, argv)
    finally:
        s.close()


def _hand_over(s: socket.socket, argv: list[str]) -> int | None:
    try:
        _connect(s)
    except _Refused as e:
        print(f"gpufault: {e}; running in-process", file=sys.stderr)
        return None
    except OSError:  # none listening, a stale socket, not root (0700 dir)
        return None
    try:
        _await_hello(s)
        umask = os.umask(0)
        os.umask(umask)
        req = wire.encode_request(argv, os.getcwd(), umask, dict(os.environ),
                                  wire.fingerprint())  # fmt: skip
        fds = wire.FDS.pack(0, 1, 2)
        s.sendmsg([req[:4096]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        if len(req) > 4096:
            s.sendall(req[4096:])
        s.settimeout(ANSWER_S)
        head = _recv_exact(s, 1 + wire.LEN.size)
        s.settimeout(None)
    except TimeoutError:
        print(f"gpufault: gpufault serve did not answer within {ANSWER_S:.0f} s; "
              "running in-process", file=sys.stderr)  # fmt: skip
        return None
    except OSError:  # a closed stdio descriptor, a server gone meanwhile
        return None
    if len(head) == 5 and head[:1] == b"S":
        return _follow(s, wire.LEN.unpack(head[1:])[0])
    if len(head) == 5 and head[:1] == b"N":
        (n,) = wire.LEN.unpack(head[1:])
        reason = _recv_exact(s, n).decode(errors="replace")
        if reason.startswith("!"):  # worth a line: the user can fix it
            print(f"gpufault: {reason[1:]}; running in-process", file=sys.stderr)
    return None


def _follow(s: socket.socket, pid: int) -> int:
    """Forward signals until the controller's status arrives."""

    def forward(signo: int, _frame: object) -> None:
        try:
            s.send(bytes((signo,)))
        except OSError:
            pass

    for signo in wire.FORWARDED:
        signal.signal(signo, forward)
    tail = _recv_exact(s, 1 + wire.STATUS.size)
    if len(tail) == 5 and tail[:1] == b"X":
        return wire.STATUS.unpack(tail[1:])[0]
    print(f"gpufault: the controller (pid {pid}, forked by gpufault serve) ended "
          "without an exit status: it was killed", file=sys.stderr)  # fmt: skip
    return EXIT_LOST


def ping() -> tuple[int, bool] | None:
    """(pid, same code as this gpufault) of the server listening, or None
    when none does (`gpufault doctor`)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        _connect(s)
        _await_hello(s)
        s.settimeout(ANSWER_S)
        s.sendall(wire.LEN.pack(len(wire.PING)) + wire.PING)
        head = _recv_exact(s, 1 + wire.LEN.size)
        if len(head) != 5 or head[:1] != b"P":
            return None
        body = _recv_exact(s, wire.LEN.unpack(head[1:])[0])
        pid, fp = body.decode("utf-8", "surrogateescape").split("\0", 1)
        return int(pid), fp == wire.fingerprint()
    except (OSError, ValueError, _Refused):
        return None
    finally:
        s.close()
