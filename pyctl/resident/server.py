"""`gpufault serve`: a resident process with the CLI and the engine
imported and the engine's BPF object loaded, which forks one controller
per `trace --pid`/`inject --pid` request. The controller is then the
process that would have run in-process, minus ~100 ms of start-up: the
fork inherits the imports and the loaded object (pyctl/bpf/main_object.py
takes it as its early object), and the server loads the next one.

Who may ask: root only (the socket is 0600 in the 0700 run directory,
and SO_PEERCRED is checked again). What is served: the same code only
(wire.fingerprint), with the same import-time environment; anything else
is answered "not served" and the client runs the command itself.

The controller is its own session (Ctrl-C in the server's terminal does
not reach it; the client forwards the user's signals) and ends with its
client: a thread reads the socket, raises each forwarded signal in the
controller, and SIGKILLs the controller when the socket closes before the
run ended (the client was killed), which leaves what killing an
in-process controller leaves: the kernel closes the links, ptrace lets go
of the target, the store keeps what it committed.
"""

from __future__ import annotations

import array
import atexit
import importlib
import io
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

from pyctl import errors, rundir
from pyctl.control import peer
from pyctl.resident import wire

# Modules a trace or inject run imports on its way (lazily, in-process):
# imported once here so each controller has them already.
PRELOAD = (
    "pyctl.cli",
    "pyctl.cli.trace",
    "pyctl.cli.inject",
    "pyctl.cli.root",
    "pyctl.engine",
    "pyctl.runner",
    "pyctl.early",
    "pyctl.symbols.resolve",
    "pyctl.evidence.store",
    "pyctl.calls.summary",
    "pyctl.symbols.symbolize",
    "pyctl.symbols.demangle",
    "pyctl.copilot",
    "pyctl.control",
    "pyctl.tracefs",
    "pyctl.xid",
)


class ServeError(Exception):
    """One line for the user (`gpufault serve` exits 2 with it)."""


class Server:
    """`command(argv)` is what each forked controller runs: the CLI's main,
    passed in by `gpufault serve` so that this module, a floor below the
    command line, never imports it."""

    def __init__(
        self, path: str, log: Callable[[str], None], command: Callable[[list[str]], object]
    ) -> None:
        self.path = path
        self.log = log
        self.command = command
        self.fp = wire.fingerprint()
        self.env = wire.import_time_env(dict(os.environ))
        self._sock: socket.socket | None = None
        self._ino = 0
        self._children: set[int] = set()

    def bind(self) -> None:
        """Listen on path; a live server there is an error, a stale
        socket (its server was killed) is replaced."""
        try:  # checked, or made 0700; never chmod-ed (pyctl/rundir.py)
            os.close(rundir.open_dir(os.path.dirname(self.path), create=True, owner=os.geteuid()))
        except rundir.UnsafeRunDir as e:
            raise ServeError(str(e)) from None
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.connect(self.path)
            raise ServeError(
                f"a gpufault serve already listens on {self.path}: stop it first "
                "(gpufault doctor names its pid), or set GPUFAULT_RUN_DIR"
            )
        except (ConnectionRefusedError, FileNotFoundError):
            if os.path.exists(self.path):
                os.unlink(self.path)
        finally:
            probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            s.bind(self.path)
            s.listen(16)
        except OSError:
            s.close()
            raise
        finally:
            os.umask(old)
        self._sock = s
        self._ino = os.stat(self.path).st_ino

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        try:  # only our own socket: a successor may have bound a new one
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass

    def preload(self) -> None:
        for m in PRELOAD:
            importlib.import_module(m)

    def serve_forever(self, ready: Callable[[], None] | None) -> None:
        """Take requests until a signal ends it; ready() runs once, when the
        first controller's object is loaded."""
        # lazy: pyctl.bpf.main_object (ctypes, +13 modules, ~100 ms) only when this runs
        from pyctl.bpf import main_object

        assert self._sock is not None
        signal.signal(signal.SIGCHLD, lambda _signo, _frame: self._reap())
        while True:
            main_object.preload()  # no thread is left running at the fork
            if ready is not None:
                ready()
                ready = None
            conn, _ = self._sock.accept()
            try:
                self._handle(conn)
            except OSError as e:  # that client's trouble (gone, stuck): not the server's
                self.log(f"request dropped: {e}")
            finally:
                conn.close()
            main_object.discard_early()  # the controller took it

    def _reap(self) -> None:
        """Reap ended controllers, by pid: a waitpid(-1) would also take a
        child that subprocess waits for (a capability trial)."""
        for pid in list(self._children):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    self._children.discard(pid)
            except ChildProcessError:
                self._children.discard(pid)

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)  # a request is one message; a stuck client is dropped
        conn.sendall(wire.HELLO)  # accepted: only now does a client send its descriptors
        pid, uid = peer(conn)
        fds: list[int] = []
        try:
            data, anc, _flags, _ = conn.recvmsg(4096, socket.CMSG_SPACE(3 * 4))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(payload[: len(payload) - len(payload) % a.itemsize])
                    fds += list(a)
            if uid != 0:
                conn.sendall(wire.not_served("not root"))
                return
            if len(data) < 4:
                conn.sendall(wire.not_served("malformed request"))
                return
            (n,) = wire.LEN.unpack(data[:4])
            body = data[4:]
            while len(body) < n:
                more = conn.recv(n - len(body))
                if not more:
                    return
                body += more
            if body == wire.PING:  # `gpufault doctor`: who listens, which code
                conn.sendall(wire.pong(os.getpid(), self.fp))
                return
            if len(fds) != 3:
                conn.sendall(wire.not_served("malformed request"))
                return
            try:
                fp, cwd, umask, argv, env = wire.decode_request(body)
            except wire.BadRequest as e:
                conn.sendall(wire.not_served(str(e)))
                return
            if fp != self.fp:
                conn.sendall(wire.not_served(
                    f"!gpufault serve (pid {os.getpid()}) runs other code than this gpufault "
                    "(upgraded or edited since it started): restart it"))  # fmt: skip
                return
            if wire.import_time_env(env) != self.env:
                conn.sendall(wire.not_served("environment differs"))
                return
            conn.settimeout(None)
            child = os.fork()
            if child == 0:
                try:
                    # Not the server's to keep: a controller holding the
                    # listening socket would queue requests nobody answers.
                    assert self._sock is not None
                    self._sock.close()
                    _controller(conn, fds, cwd, umask, argv, env, self.command)
                finally:
                    os._exit(errors.EXIT_INTERNAL)  # only if it raised
            self._children.add(child)
            self._reap()  # one that ended before it was in the set
            self.log(f"pid {pid}: controller {child}: gpufault {' '.join(argv)}")
        finally:
            for fd in fds:
                os.close(fd)


def _controller(conn: socket.socket, fds: list[int], cwd: str, umask: int,
                argv: list[str], env: dict[str, str],
                command: Callable[[list[str]], object]) -> None:  # fmt: skip
    """In the forked child: become the client's controller, run argv, send
    the status, exit. Never returns."""
    os.setsid()
    try:
        conn.sendall(b"S" + wire.LEN.pack(os.getpid()))
    except OSError:  # the client gave up waiting (it runs in-process): not ours
        os._exit(0)
    for signo in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signo, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for i, fd in enumerate(fds):
        os.dup2(fd, i)  # inheritable, as an in-process controller's are
    for fd in fds:
        if fd > 2:  # received inheritable: its helpers must not get copies
            os.close(fd)
    _reopen_stdio()
    # The server's '' or relative sys.path entries (a `python -c` server)
    # would name the client's directory after the chdir: a module planted
    # there must not be imported by a root controller.
    sys.path[:] = [p for p in sys.path if os.path.isabs(p)]
    os.chdir(cwd)
    os.umask(umask)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["gpufault", *argv]
    done = threading.Event()
    threading.Thread(target=_watch, args=(conn, done), name="gf-client", daemon=True).start()
    status = 0
    try:
        _attach_early(argv)
        command(argv)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    # What an interpreter's exit runs (netchaos registers its cleanup so);
    # a normal exit here would unwind into the server's loop and finally.
    atexit._run_exitfuncs()
    done.set()
    try:
        conn.sendall(b"X" + wire.STATUS.pack(status))
    except OSError:
        pass
    os._exit(status)


def _attach_early(argv: list[str]) -> None:
    """A plain `trace --pid`: its probes in before click parses the line
    (pyctl/early.py), as in-process (pyctl/entry.py)."""
    # lazy: both imported by the server's preload (the engine, the argv reader)
    from pyctl import early
    from pyctl.argv import plain_trace

    plain = plain_trace(argv)
    if plain is None:
        return
    try:
        early.attach(plain)
    except KeyboardInterrupt:  # Ctrl-C before the CLI's handlers: as the CLI says it
        print("gpufault: interrupted", file=sys.stderr)
        raise SystemExit(errors.EXIT_INTERRUPTED) from None


def _watch(conn: socket.socket, done: threading.Event) -> None:
    me = os.getpid()
    while True:
        try:
            b = conn.recv(64)
        except OSError:
            b = b""
        if not b:
            if not done.is_set():  # the client is gone: end as it would have
                os.kill(me, signal.SIGKILL)
            return
        for signo in b:
            if signo in wire.FORWARDED:
                os.kill(me, signo)


def _reopen_stdio() -> None:
    """sys.std* as the interpreter would have made them for these fds."""

    def text(fd: int, mode: str, errors: str, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        buf = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(buf, encoding="utf-8", errors=errors,  # type: ignore[arg-type]
                                line_buffering=line)  # fmt: skip

    sys.stdin = text(0, "r", "strict", False)
    sys.stdout = text(1, "w", "strict", os.isatty(1))
    sys.stderr = text(2, "w", "backslashreplace", True)
