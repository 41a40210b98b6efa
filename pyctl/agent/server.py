"""The node agent's server: authenticated connections, faults armed as
isolated child sessions (pyctl.api.session.arm(..., isolate=True)), each
bound to a dead-man lease, fires and counters streamed to the controller
that armed them.

    server = AgentServer(["unix:/run/gpufault/agent.sock"], db="/var/lib/gpufault/gpufault.db")
    server.bind()              # BadInput: one line (port in use, a bad cert, ...)
    server.serve_forever()     # or .start() for a thread; .close() disarms everything

Every fault ends by itself: a lease that is not renewed disarms it within
the lease interval (the watcher wakes at the expiry), and its `duration`
is the kernel-side deadline, which holds if the agent is SIGKILLed (its
child controllers also disarm on their parent's death: PR_SET_PDEATHSIG
and their request pipe's EOF).
"""

from __future__ import annotations

import errno
import json
import os
import queue
import re
import secrets
import socket
import ssl
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyctl import __version__, rundir
from pyctl.agent import auth, protocol
from pyctl.agent.lease import MAX_LEASE_S, MIN_LEASE_S, Lease, Leases
from pyctl.agent.protocol import Message, ProtocolError
from pyctl.api.errors import BadInput, GpufaultError
from pyctl.evidence import hostid
from pyctl.stopsignals import on_stop_signals

DEFAULT_SOCKET = "/run/gpufault/agent.sock"
DEFAULT_LEASE_S = 10.0
HELLO_TIMEOUT_S = 10.0  # handshake and hello: a connection that says nothing is dropped
MAX_CONNECTIONS = 64
MAX_QUEUED_EVENTS = 10_000  # per connection; past it fire events are counted, not queued
MAX_SESSIONS = 256


@dataclass(frozen=True)
class Listen:
    transport: str  # unix, tls
    path: str = ""
    host: str = ""
    port: int = 0

    @classmethod
    def parse(cls, text: str) -> Listen:
        if text.startswith("unix:"):
            p = text[len("unix:") :]
            if not p.startswith("/"):
                raise BadInput(
                    f"--listen {text}: give an absolute path (unix:/run/gpufault/agent.sock)"
                )
            return cls("unix", path=os.path.normpath(p))
        if text.startswith("tls://"):
            host, port = _host_port(text[len("tls://") :], text)
            return cls("tls", host=host, port=port)
        if text.startswith(("tcp://", "http://")) or text[:1].isdigit():
            raise BadInput(f"--listen {text}: plain TCP is refused: use tls://HOST:PORT")
        raise BadInput(f"--listen {text}: use unix:PATH or tls://HOST:PORT")

    def url(self) -> str:
        if self.transport == "unix":
            return f"unix:{self.path}"
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"tls://{h}:{self.port}"


def _host_port(hp: str, text: str) -> tuple[str, int]:
    if hp.startswith("["):
        host, _, rest = hp[1:].partition("]")
        port_s = rest.removeprefix(":")
    else:
        host, _, port_s = hp.rpartition(":")
    if not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise BadInput(f"{text}: give HOST:PORT (tls://0.0.0.0:7450, tls://[::1]:7450)")
    return host, int(port_s)


@dataclass
class AgentSession:
    """One armed session and what the agent knows of it."""

    sid: str
    handle: Any  # pyctl.api.session.IsolatedSession
    lease: Lease
    peer: str
    armed_at: float  # wall
    duration: float
    conn: _Conn | None
    ended_by: str = ""  # lease-expired, disarmed, deadline, target-ended, agent-stopped, failed
    ended: threading.Event = field(default_factory=threading.Event)

    def to_json(self) -> dict[str, Any]:
        h = self.handle
        c = h.counters
        return {
            "session": self.sid,
            "run_id": h.run_id,
            "mechanism": h.mechanism,
            "status": h.status,
            "target": h.target.to_json(),
            "functions": sorted(
                {f for s in h.specs for f in ([s.fn] if isinstance(s.fn, str) else s.fn)}
            ),
            "lease_s": self.lease.lease_s,
            "renewals": self.lease.renewals,
            "duration": self.duration,
            "armed_at": self.armed_at,
            "peer": self.peer,
            "ended_by": self.ended_by,
            "calls": c.calls,
            "fires": c.fires,
            "lost": c.lost,
        }


class _Conn:
    """One authenticated connection: answers and events go out through a
    queue and a writer thread, so a slow reader never holds a session's
    fire path (the child controller's pipe)."""

    def __init__(self, sock: socket.socket, peer: auth.Peer) -> None:
        self.sock = sock
        self.peer = peer
        self.out: queue.Queue[bytes | None] = queue.Queue()
        self.dropped = 0
        self.closed = threading.Event()
        self._writer = threading.Thread(target=self._write, name="gf-agent-out", daemon=True)
        self._writer.start()

    def send(self, kind: str, id: int | None = None, **body: Any) -> None:
        if not self.closed.is_set():
            self.out.put(protocol.encode(kind, id, **body))

    def event(self, kind: str, **body: Any) -> None:
        if self.out.qsize() >= MAX_QUEUED_EVENTS:
            self.dropped += 1
            return
        self.send(kind, **body)

    def _write(self) -> None:
        while True:
            data = self.out.get()
            if data is None:
                break
            try:
                self.sock.sendall(data)
            except OSError:
                break
        self.closed.set()

    def close(self) -> None:
        """Flush what is queued, then close (lingering: see _linger)."""
        self.out.put(None)
        self._writer.join(5)
        self.closed.set()
        _linger(self.sock)


# Kubernetes' label syntax (an optional DNS prefix, a name of 63
# characters), so the DaemonSet can pass a node's labels as they are.
_LABEL_KEY = re.compile(
    r"^(?:[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    """labels as given, or BadInput naming the first bad one."""
    for k, v in labels.items():
        if not _LABEL_KEY.match(k) or not _LABEL_VALUE.match(v):
            raise BadInput(
                f"--label {k}={v}: a key is [prefix/]name and a value up to 63 letters, "
                "digits, '-', '_' or '.' (Kubernetes' label syntax)"
            )
    return dict(labels)


class AgentServer:
    def __init__(
        self,
        listen: list[str],
        *,
        db: str,
        cert: str | None = None,
        key: str | None = None,
        client_ca: str | None = None,
        token_file: str | None = None,
        default_lease_s: float = DEFAULT_LEASE_S,
        log: Callable[[str], None] | None = None,
        node: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> None:
        if not listen:
            raise BadInput("--listen: give unix:PATH or tls://HOST:PORT")
        self.listens = [Listen.parse(x) for x in listen]
        self.db = str(db)
        # What the hello says this node is: controllers choose and check
        # agents by it (pyctl/experiment/agents.py).
        self.node = node or socket.gethostname()
        self.labels = check_labels(labels or {})
        self.log = log or (lambda _s: None)
        self.default_lease_s = _lease(default_lease_s)
        self.token = auth.read_token(token_file) if token_file else None
        self.require_cert = bool(client_ca)
        self.tls: ssl.SSLContext | None = None
        if any(x.transport == "tls" for x in self.listens):
            if not (client_ca or self.token):
                raise BadInput(
                    "a TLS listener needs --client-ca (mutual TLS) or --token-file (a bearer "
                    "token): an unauthenticated controller is refused"
                )
            if not cert or not key:
                raise BadInput("a TLS listener needs --cert and --key (the agent's certificate)")
            self.tls = auth.server_context(cert, key, client_ca)
        self.started = time.time()
        self.bound: list[Listen] = []
        self._socks: list[socket.socket] = []
        self._unix: list[tuple[int, str, int]] = []  # (dir fd, name, inode)
        self._sessions: dict[str, AgentSession] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.leases = Leases(self._expired)

    # ---- listening ---------------------------------------------------------
    def bind(self) -> None:
        try:
            for x in self.listens:
                self._socks.append(
                    self._bind_unix(x) if x.transport == "unix" else self._bind_tls(x)
                )
        except BaseException:
            self.close()
            raise

    def _bind_unix(self, x: Listen) -> socket.socket:
        d, name = os.path.split(x.path)
        try:
            dfd = rundir.open_dir(d, create=True, owner=0)
        except rundir.UnsafeRunDir as e:
            raise BadInput(str(e)) from None
        except OSError as e:
            raise BadInput(f"{x.url()}: {d}: {e.strerror}") from None
        path = rundir.fd_path(dfd, name)  # through the checked descriptor, not the name
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                os.close(dfd)
                raise BadInput(
                    f"{x.path} exists and is not a socket: remove it or listen elsewhere"
                )
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(path)
                os.close(dfd)
                raise BadInput(f"an agent already listens on {x.path}: stop it first")
            except OSError:
                os.unlink(name, dir_fd=dfd)  # a dead agent's socket
            finally:
                probe.close()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file 0600 from its first instant
        try:
            s.bind(path)
        except OSError as e:
            s.close()
            os.close(dfd)
            raise BadInput(f"cannot listen on {x.path}: {e.strerror}") from None
        finally:
            os.umask(old)
        s.listen(64)
        self._unix.append((dfd, name, os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino))
        self.bound.append(x)
        return s

    def _bind_tls(self, x: Listen) -> socket.socket:
        fam = socket.AF_INET6 if ":" in x.host else socket.AF_INET
        try:
            s = socket.create_server((x.host, x.port), family=fam, backlog=64)
        except OSError as e:
            why = "port in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise BadInput(f"cannot listen on {x.url()}: {why}") from None
        self.bound.append(Listen("tls", host=x.host, port=s.getsockname()[1]))
        return s

    @property
    def urls(self) -> list[str]:
        return [x.url() for x in self.bound]

    def start(self) -> AgentServer:
        """Accept on threads of their own; returns at once."""
        for s, x in zip(self._socks, self.bound, strict=True):
            t = threading.Thread(target=self._accept, args=(s, x), name="gf-agent-accept",
                                 daemon=True)  # fmt: skip
            t.start()
            self._threads.append(t)
        threading.Thread(target=self._ticker, name="gf-agent-ticker", daemon=True).start()
        return self

    def serve_forever(self, ready: Callable[[], None] | None = None) -> None:
        self.start()
        if ready is not None:
            ready()
        self._stop.wait()

    def stop(self) -> None:
        self._stop.set()

    def stop_on_signals(self) -> None:
        """SIGTERM and SIGINT stop serve_forever (main thread only), from a
        thread: Event.set in a handler can deadlock on a second signal
        (pyctl/stopsignals.py)."""
        on_stop_signals(self.stop, name="gf-agent-signal")

    def close(self) -> None:
        """Stop listening, disarm every session (recorded as agent-stopped),
        remove the socket file if it is still ours."""
        self._stop.set()
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._socks = []
        for dfd, name, ino in self._unix:
            try:
                if os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino == ino:
                    os.unlink(name, dir_fd=dfd)
            except OSError:
                pass
            os.close(dfd)
        self._unix = []
        with self._lock:
            live = list(self._sessions.values())
        for sess in live:
            self._end(sess, "agent-stopped")
        for sess in live:
            sess.ended.wait(10)
        self.leases.close()

    def _accept(self, s: socket.socket, x: Listen) -> None:
        while not self._stop.is_set():
            try:
                c, addr = s.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                c.close()  # past the cap: nothing read, nothing answered
                continue
            t = threading.Thread(target=self._serve_conn, args=(c, x, addr),
                                 name="gf-agent-conn", daemon=True)  # fmt: skip
            try:
                t.start()
            except BaseException as e:
                # A thread that never ran (no thread could be made: its
                # finally never releases) gives its slot and socket back
                # here; one interrupted after it ran released them itself.
                if t.ident is None:
                    self._slots.release()
                    c.close()
                if not isinstance(e, RuntimeError):
                    raise
                self.log(f"connection from {addr or 'unix'} dropped: {e}")

    # ---- one connection ------------------------------------------------------
    def _serve_conn(self, c: socket.socket, x: Listen, addr: Any) -> None:
        conn: _Conn | None = None
        try:
            c.settimeout(HELLO_TIMEOUT_S)
            got = self._authenticate_transport(c, x, addr)
            if got is None:
                return
            c, peer = got
            if isinstance(peer, str):
                _refuse(c, peer)
                self.log(f"refused {peer}")
                return
            sock = c
            conn = _Conn(sock, peer)
            f = sock.makefile("rb")
            if not self._hello(conn, f):
                return
            sock.settimeout(None)  # renewals keep it busy; its sessions' leases bound it
            self.log(f"connected: {peer.describe()}")
            while True:
                line = f.readline(protocol.MAX_LINE + 1)
                if not line:
                    break
                try:
                    msg = protocol.decode(line)
                except ProtocolError as e:
                    conn.send("error", message=f"protocol: {e}")
                    break
                self._dispatch(conn, msg)
        except (OSError, ValueError):
            pass
        finally:
            if conn is not None:
                with self._lock:
                    for sess in self._sessions.values():
                        if sess.conn is conn:
                            sess.conn = None  # the lease decides, not the connection
                conn.close()
            else:
                try:
                    c.close()
                except OSError:
                    pass
            self._slots.release()

    def _authenticate_transport(
        self, c: socket.socket, x: Listen, addr: Any
    ) -> tuple[socket.socket, auth.Peer | str] | None:
        """(the socket to use, who it is) or (the socket, why it is refused);
        None when nothing can be said (a failed TLS handshake)."""
        if x.transport == "unix":
            peer = auth.unix_peer(c)
            if peer.uid != 0:
                return c, f"unix peer pid {peer.pid} uid {peer.uid}: only root may use the agent"
            return c, peer
        assert self.tls is not None
        try:
            t = self.tls.wrap_socket(c, server_side=True, do_handshake_on_connect=False)
            t.do_handshake()
        except (ssl.SSLError, OSError) as e:
            # No line is possible: there is no TLS session to carry it.
            why = getattr(e, "reason", None) or e
            self.log(f"refused tls peer {addr[0]}:{addr[1]}: handshake: {why}")
            c.close()
            return None
        # A required client certificate was checked by the handshake itself.
        return t, auth.Peer("tls", f"{addr[0]}:{addr[1]}", subject=auth.tls_subject(t))

    def _hello(self, conn: _Conn, f: Any) -> bool:
        line = f.readline(protocol.MAX_LINE + 1)
        try:
            msg = protocol.decode(line) if line else None
        except ProtocolError as e:
            conn.send("error", message=f"protocol: {e}")
            return False
        if msg is None:
            return False
        if msg.kind != "hello":
            conn.send("error", msg.id, message="refused: say hello first")
            return False
        if conn.peer.transport == "tls" and self.token is not None:
            if not auth.token_matches(msg.get("token"), self.token):
                self.log(f"refused {conn.peer.describe()}: bad or missing token")
                conn.send("error", msg.id, message="refused: bad or missing token")
                return False
        how = "unix"
        if conn.peer.transport == "tls":
            how = "+".join(["mtls"] * self.require_cert + ["token"] * (self.token is not None))
        conn.send("ok", msg.id, agent=socket.gethostname(), version=__version__,
                  protocol=protocol.VERSION, pid=os.getpid(), auth=how, node=self.node,
                  labels=self.labels, host_part=hostid.host_part())  # fmt: skip
        return True

    def _dispatch(self, conn: _Conn, msg: Message) -> None:
        handlers: dict[str, Callable[[_Conn, Message], None]] = {
            "arm": self._arm, "renew": self._renew, "disarm": self._disarm,
            "status": self._status, "sessions": self._list, "pull": self._pull,
        }  # fmt: skip
        h = handlers.get(msg.kind)
        if h is None:
            conn.send("error", msg.id, message=f"{msg.kind} is not a request here")
            return
        if msg.kind in ("arm", "disarm", "pull"):
            # They take up to arm_timeout / the child's exit: off the reader,
            # so renewals on this connection are never held behind them.
            threading.Thread(target=self._guarded, args=(h, conn, msg), daemon=True,
                             name=f"gf-agent-{msg.kind}").start()  # fmt: skip
        else:
            self._guarded(h, conn, msg)

    def _guarded(self, h: Callable[[_Conn, Message], None], conn: _Conn, msg: Message) -> None:
        try:
            h(conn, msg)
        except GpufaultError as e:
            conn.send("error", msg.id, message=str(e), type=type(e).__name__)
        except Exception as e:  # noqa: BLE001 - every request is answered, a bug included
            conn.send("error", msg.id, message=f"internal: {type(e).__name__}: {e}")

    # ---- requests ----------------------------------------------------------
    def _arm(self, conn: _Conn, msg: Message) -> None:
        # lazy: the engine (+60 modules) loads on the first arm, not at start-up
        from pyctl.api.faults import spec_from_json
        from pyctl.api.session import arm
        from pyctl.api.target import Target

        specs_j = msg.get("specs")
        if (
            not isinstance(specs_j, list)
            or not specs_j
            or not all(isinstance(d, dict) for d in specs_j)
        ):
            raise BadInput("arm: specs: a list of FaultSpec.to_json() objects")
        specs = [spec_from_json(d) for d in specs_j]
        tj = msg.get("target")
        keys = {"pid", "tid", "command", "selector", "value", "thread_name"}
        if not isinstance(tj, dict) or set(tj) - keys:
            raise BadInput('arm: target: {"pid": N}, {"tid": N} or {"selector": "pod", '
                           '"value": "NAMESPACE/NAME"} (container, cgroup, comm, ranks_of)')
        if tj.get("command"):
            raise BadInput("arm: the agent arms in running processes: give a pid, a tid "
                           "or a selector")  # fmt: skip
        for k in ("pid", "tid"):
            v = tj.get(k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise BadInput(f"arm: target {k}: {v!r} is not a {k}")
        for k in ("value", "thread_name"):
            if not isinstance(tj.get(k) or "", str):
                raise BadInput(f"arm: target {k}: a string")
        # A selector (a pod, a container, ...) is resolved here, on this
        # node, where its cgroups and runtime state are: one process, or
        # the one line that says how many.
        target = Target.from_json(tj)
        if not (target.pid or target.tid or target.selector):
            raise BadInput("arm: target: give a pid, a tid or a selector")
        duration = _number(msg.get("duration"), "duration")
        if duration <= 0:
            raise BadInput(
                "arm: duration: give seconds > 0: every fault the agent arms ends by itself"
            )
        lease_s = _lease(msg.get("lease_s", self.default_lease_s))
        with self._lock:
            if len(self._sessions) >= MAX_SESSIONS:
                raise BadInput(f"arm: {MAX_SESSIONS} sessions are armed here already")
        sid = secrets.token_hex(6)
        box: dict[str, AgentSession] = {}

        def fired(f: Any) -> None:
            sess = box.get("s")
            c = sess.conn if sess is not None else conn
            if c is not None:
                c.event("fire", session=sid, fault_id=f.fault_id, wall=f.wall,
                        function=f.function, tid=f.tid, action=f.action)  # fmt: skip

        h = arm(specs, target, db=self.db, duration=duration, isolate=True, kind="agent",
                on_fire=fired)  # fmt: skip
        lease = self.leases.grant(sid, lease_s)
        sess = AgentSession(sid, h, lease, conn.peer.describe(), time.time(), duration, conn)
        box["s"] = sess
        with self._lock:
            self._sessions[sid] = sess
        threading.Thread(target=self._await_end, args=(sess,), name="gf-agent-end",
                         daemon=True).start()  # fmt: skip
        self.log(
            f"armed session {sid} run {h.run_id} in {target.describe()} for "
            f"{conn.peer.describe()} (lease {lease_s:g}s, duration {duration:g}s)"
        )
        conn.send("ok", msg.id, session=sid, run_id=h.run_id, mechanism=h.mechanism,
                  lease_s=lease_s, duration=duration, db=self.db)  # fmt: skip

    def _session(self, msg: Message) -> AgentSession:
        sid = msg.get("session")
        with self._lock:
            sess = self._sessions.get(sid) if isinstance(sid, str) else None
        if sess is None:
            raise BadInput(f"session {sid!r} is not armed here (ended, or its lease expired)")
        return sess

    def _renew(self, conn: _Conn, msg: Message) -> None:
        sess = self._session(msg)
        lease = self.leases.renew(sess.sid)
        if lease is None or sess.ended_by:
            raise BadInput(f"session {sess.sid} is ending ({sess.ended_by or 'lease expired'})")
        if sess.conn is None:
            sess.conn = conn  # a controller that reconnected gets the events again
        conn.send("ok", msg.id, session=sess.sid, lease_s=lease.lease_s)

    def _disarm(self, conn: _Conn, msg: Message) -> None:
        sess = self._session(msg)
        self._end(sess, "disarmed")
        sess.ended.wait(30)
        conn.send("ok", msg.id, **sess.to_json())

    def _status(self, conn: _Conn, msg: Message) -> None:
        conn.send("ok", msg.id, **self.status())

    def _list(self, conn: _Conn, msg: Message) -> None:
        conn.send("ok", msg.id, sessions=self.sessions())

    def _pull(self, conn: _Conn, msg: Message) -> None:
        """The node's store as one consistent snapshot (SQLite's backup of
        a read-only connection, taken while sessions write), sent as data
        events and then the answer with its size and sha256. The writer
        queue is kept short, so a large store is never all in memory."""
        # lazy: pyctl.agent.snapshot (sqlite3, the store's checks) only for a pull
        from pyctl.agent import snapshot

        with snapshot.taken(self.db) as snap:
            seq = 0
            for chunk in snap.chunks(protocol.DATA_CHUNK):
                while conn.out.qsize() > 8 and not conn.closed.is_set():
                    conn.closed.wait(0.01)  # the writer drains it: backpressure, not a sync
                if conn.closed.is_set():
                    return
                conn.send("data", pull=msg.id, seq=seq, b64=chunk)
                seq += 1
            conn.send("ok", msg.id, chunks=seq, **snap.facts())

    # ---- the library surface --------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._lock:
            n = len(self._sessions)
        return {
            "agent": socket.gethostname(), "version": __version__, "protocol": protocol.VERSION,
            "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 3),
            "listen": self.urls, "db": self.db, "sessions": n,
            "default_lease_s": self.default_lease_s, "node": self.node,
            "labels": self.labels, "host_part": hostid.host_part(),
        }  # fmt: skip

    def sessions(self) -> list[dict[str, Any]]:
        with self._lock:
            return [s.to_json() for s in self._sessions.values()]

    # ---- ends ----------------------------------------------------------------
    def _expired(self, lease: Lease) -> None:
        with self._lock:
            sess = self._sessions.get(lease.key)
        if sess is not None:
            self._end(sess, "lease-expired")

    def _end(self, sess: AgentSession, why: str) -> None:
        """Stop now (SIGTERM to the child; returns at once): the first
        reason given is the one recorded."""
        if not sess.ended_by:
            sess.ended_by = why
        self.leases.release(sess.sid)
        sess.handle.stop()

    def _await_end(self, sess: AgentSession) -> None:
        h = sess.handle
        h.wait()
        if h.proc is not None:
            h.proc.wait()
        h.disarm(timeout=5)  # joins the reader, closes the pipe
        self.leases.release(sess.sid)
        if not sess.ended_by:
            deadline = h.started_at + sess.duration
            sess.ended_by = (
                "failed" if h.status == "failed"
                else "deadline" if (h.ended_at or time.time()) >= deadline - 0.5
                else "target-ended"
            )  # fmt: skip
        lease = sess.lease
        why = {
            "ended_by": sess.ended_by,
            "session": sess.sid,
            "peer": sess.peer,
            "lease_s": lease.lease_s,
            "renewals": lease.renewals,
            # wall time of the watcher's expiry: what a reader compares fire walls with
            "lease_expired_at": (
                None
                if lease.expired_at is None
                else round(time.time() - (time.monotonic() - lease.expired_at), 4)
            ),  # fmt: skip
            "since_last_renewal_s": round(
                (lease.expired_at or time.monotonic()) - lease.renewed, 4
            ),
            "agent_pid": os.getpid(),
        }
        try:
            record_end(self.db, h.run_id, why)
        except Exception as e:  # noqa: BLE001 - the run row is closed; this adds why
            self.log(f"session {sess.sid}: could not record why it ended: {e}")
        with self._lock:
            self._sessions.pop(sess.sid, None)
        self.log(f"session {sess.sid} run {h.run_id} ended: {sess.ended_by} "
                 f"({h.counters.fires} fires)")  # fmt: skip
        c = sess.conn
        if c is not None:
            c.send("ended", **sess.to_json())
        sess.ended.set()

    def _ticker(self) -> None:
        """Counters to each session's controller once a second, when they moved."""
        last: dict[str, tuple[int, int, int]] = {}
        while not self._stop.wait(1.0):
            with self._lock:
                live = list(self._sessions.values())
            for sess in live:
                c = sess.handle.counters
                now = (c.calls, c.fires, c.lost)
                if last.get(sess.sid) != now and sess.conn is not None:
                    last[sess.sid] = now
                    sess.conn.event("counters", session=sess.sid, calls=c.calls, fires=c.fires,
                                    lost=c.lost, unfinished=c.unfinished)  # fmt: skip


def record_end(db: str, run_id: str, why: dict[str, Any]) -> None:
    """Why the agent ended the run, as runs.stats' "agent" key: one
    statement (json_set), after the child closed the row, so the
    controller's own stats stay whole beside it."""
    # lazy: the store (+10 modules) is loaded by the first session's end
    from pyctl.evidence import store

    d = store.open_db(db)
    try:
        with d.conn:
            d.conn.execute(
                "UPDATE runs SET stats = json_set(coalesce(stats, '{}'), '$.agent', json(?)) "
                "WHERE run_id = ?",
                (json.dumps(why, sort_keys=True), run_id),
            )
    finally:
        d.close()


def _refuse(c: socket.socket, why: str) -> None:
    try:
        c.settimeout(2.0)
        c.sendall(protocol.encode("error", message=f"refused: {why}"))
    except OSError:
        pass
    _linger(c)


def _linger(c: socket.socket, limit: int = 1 << 20, timeout: float = 1.0) -> None:
    """Close after the peer has our last line: a close with its unread
    requests in our buffer would reset the connection, and the reset can
    reach the peer before the error line it was meant to read."""
    try:
        c.shutdown(socket.SHUT_WR)
        c.settimeout(timeout)
        got = 0
        while got < limit:
            chunk = c.recv(65536)
            if not chunk:
                break
            got += len(chunk)
    except (OSError, ValueError):
        pass
    finally:
        try:
            c.close()
        except OSError:
            pass


def _number(v: object, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadInput(f"{what}: give seconds (a number)")
    return float(v)


def _lease(v: object) -> float:
    s = _number(v, "lease_s")
    if not MIN_LEASE_S <= s <= MAX_LEASE_S:
        raise BadInput(f"lease_s: {s:g} is outside [{MIN_LEASE_S:g}, {MAX_LEASE_S:g}] seconds")
    return s


__all__ = ["DEFAULT_LEASE_S", "DEFAULT_SOCKET", "AgentServer", "AgentSession", "Listen",
           "record_end"]  # fmt: skip
