"""A controller's side of the node agent.

    with AgentClient.connect("tls://node7:7450", token_file="/etc/gpufault/agent.token",
                             ca="/etc/gpufault/ca.pem") as agent:
        h = agent.arm(Fault.fail("libcuda", "cuMemAlloc_v2", ret=2, nth=3),
                      Target.process(1234), lease_s=10, duration=60)
        h.wait_fires(1, timeout=30)
        print(h.counters, h.fired())
        h.disarm()

The client renews each session's lease every lease/3 on a thread of its
own; when this process dies or the link is cut the renewals stop and the
agent disarms at the lease's end. A Unix socket is reached through its
checked directory, and only a listener whose SO_PEERCRED uid is 0 gets a
byte (pyctl/rundir.connect_root).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from pyctl import rundir
from pyctl.agent import auth, protocol
from pyctl.agent.protocol import Message, ProtocolError
from pyctl.api import errors as E
from pyctl.api.errors import BadInput, GpufaultError
from pyctl.api.session import Counters, Fire
from pyctl.api.target import Target

CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 30.0
ARM_TIMEOUT_S = 150.0  # the agent's own arm_timeout (120 s) and the round trip
PULL_IDLE_S = 60.0  # a pull may take long; 60 s without a chunk is a link gone


class AgentError(GpufaultError):
    """What the agent answered instead of ok (its one line), or a lost link."""


class AgentRefused(AgentError):
    """The agent would not talk to us (authentication)."""


def _error(msg: Message) -> AgentError:
    text = str(msg.get("message") or "error")
    if text.startswith("refused"):
        return AgentRefused(text)
    cls = getattr(E, str(msg.get("type")), None)
    if isinstance(cls, type) and issubclass(cls, GpufaultError):
        # The library's own class, with the agent's line, so callers can
        # catch BadInput / TargetGone as they would for a local arm().
        return type(f"Agent{cls.__name__}", (AgentError, cls), {})(text)
    return AgentError(text)


class RemoteSession:
    """A session armed by an agent: live counters and fires as the agent
    streams them, its lease renewed by the client until disarm()."""

    def __init__(
        self, client: AgentClient, answer: Message, on_fire: Callable[[Fire], None] | None
    ):
        self.client = client
        self.session = str(answer.get("session"))
        self.run_id = str(answer.get("run_id"))
        self.mechanism = str(answer.get("mechanism"))
        self.lease_s = float(answer.get("lease_s"))
        self.duration = float(answer.get("duration"))
        self.db = str(answer.get("db"))
        self.on_fire = on_fire
        self.ended_by = ""  # the agent's reason, once it ended
        self.armed_at = time.time()  # when its answer was read: every probe attached
        self.ended_at: float | None = None  # when this client learnt it ended
        self.status = "armed"
        self.last_renewal = time.monotonic()
        self.renewing = True
        self._counters = Counters()
        self._fires: list[Fire] = []
        self._cond = threading.Condition()
        self._ended = threading.Event()

    # ---- what the agent streams ------------------------------------------
    def _event(self, msg: Message) -> None:
        if msg.kind == "fire":
            f = Fire(**{k: msg.get(k) for k in Fire.__dataclass_fields__ if k in msg.body})
            with self._cond:
                self._fires.append(f)
                self._counters.fires = max(self._counters.fires, len(self._fires))
                self._cond.notify_all()
            if self.on_fire is not None:
                try:
                    self.on_fire(f)
                except Exception:  # noqa: BLE001 - a harness's callback never ends the link
                    pass
        elif msg.kind in ("counters", "ended"):
            c = self._counters
            c.calls = int(msg.get("calls", c.calls))
            c.fires = max(c.fires, int(msg.get("fires", c.fires)))
            c.lost = int(msg.get("lost", c.lost))
            c.unfinished = int(msg.get("unfinished", c.unfinished))
            if msg.kind == "ended":
                self._mark_ended(str(msg.get("ended_by") or "ended"), str(msg.get("status") or ""))

    def _mark_ended(self, why: str, status: str = "") -> None:
        with self._cond:
            if not self._ended.is_set():
                self.ended_by, self.status = why, status or "done"
                self.ended_at = time.time()
                self.renewing = False
                self._ended.set()
            self._cond.notify_all()

    # ---- the public surface ---------------------------------------------------
    @property
    def counters(self) -> Counters:
        c = self._counters
        return Counters(c.calls, c.fires, c.lost, c.unfinished)

    @property
    def fires(self) -> int:
        return self.counters.fires

    @property
    def active(self) -> bool:
        return not self._ended.is_set()

    def fired(self) -> list[Fire]:
        with self._cond:
            return list(self._fires)

    def wait_fires(self, n: int = 1, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._fires) < n:
                if self._ended.is_set():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            return True

    def wait(self, timeout: float | None = None) -> bool:
        """True once the agent said the session ended (ended_by says why)."""
        return self._ended.wait(timeout)

    def renew(self) -> float:
        """Extend the lease now; returns its interval. AgentError if the
        session is gone (its lease expired: the fault is off)."""
        try:
            ans = self.client.request("renew", session=self.session)
        except AgentError:
            self._mark_ended("lease-lost", "done")
            raise
        self.last_renewal = time.monotonic()
        return float(ans.get("lease_s"))

    def stop_renewals(self) -> None:
        """Let the lease run out, as a controller that died would."""
        self.renewing = False

    def disarm(self) -> None:
        """Disarm now; returns once the agent closed the run. Idempotent."""
        self.renewing = False
        if self._ended.is_set():
            return
        try:
            ans = self.client.request("disarm", session=self.session)
        except AgentError:
            self._mark_ended(self.ended_by or "gone")
            return
        self._event(Message("ended", ans.body))

    close = disarm

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *_: object) -> None:
        self.disarm()

    def __repr__(self) -> str:
        c = self.counters
        return (f"<gpufault agent session {self.session} run {self.run_id} {self.status}: "
                f"{c.calls} calls, {c.fires} fires, {c.lost} lost>")  # fmt: skip


class AgentClient:
    def __init__(self, sock: socket.socket, url: str) -> None:
        self.url = url
        self.sock = sock
        self.hello: dict[str, Any] = {}
        self._f = sock.makefile("rb")
        self._wlock = threading.Lock()
        self._plock = threading.Lock()
        self._next = 1
        self._pending: dict[int, tuple[threading.Event, list[Message]]] = {}
        self._pulls: dict[int, Callable[[Message], None]] = {}  # a pull's data sink
        self._sessions: dict[str, RemoteSession] = {}
        self._early: dict[str, list[Message]] = {}  # events before arm's answer is read
        self._closed = threading.Event()
        self.lost: str = ""
        self._reader = threading.Thread(target=self._read, name="gf-agent-client", daemon=True)
        self._renewer = threading.Thread(target=self._renew_loop, name="gf-agent-renew",
                                         daemon=True)  # fmt: skip

    @classmethod
    def connect(
        cls,
        url: str,
        *,
        token_file: str | os.PathLike[str] | None = None,
        token: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        ca: str | None = None,
        server_hostname: str | None = None,
        timeout: float = CONNECT_TIMEOUT_S,
    ) -> AgentClient:
        """unix:PATH or tls://HOST:PORT. TLS: the agent's certificate is
        checked against `ca` and its name; `cert`/`key` for mutual TLS,
        `token_file` (root's, 0600) or `token` for a bearer token."""
        if token_file is not None:
            token = auth.read_token(token_file)
        if url.startswith("unix:"):
            sock = _connect_unix(url[len("unix:") :], timeout)
        elif url.startswith("tls://"):
            sock = _connect_tls(url, cert, key, ca, server_hostname, timeout)
        else:
            raise BadInput(f"agent {url}: use unix:PATH or tls://HOST:PORT")
        c = cls(sock, url)
        try:
            hello: dict[str, Any] = {"token": token} if token else {}
            ans = c._hello(hello)
        except BaseException:
            c.close(disarm=False)
            raise
        # The reader starts only now, blocking without a timeout: a read
        # begun under the connect timeout would end an idle link (a
        # controller that connects before its first arm) after it; and the
        # hello is read here, not beside the reader, because a blocking TLS
        # read while the same socket writes, right after the handshake (TLS
        # 1.3's session tickets arrive then), lost the hello 1 time in 4.
        sock.settimeout(None)
        c._reader.start()
        c.hello = dict(ans.body)
        c._renewer.start()
        return c

    def _hello(self, body: dict[str, Any]) -> Message:
        """The first request and its answer, on this thread, under the
        connect timeout (the reader is not started yet)."""
        try:
            self.sock.sendall(protocol.encode("hello", 0, **body))
            line = self._f.readline(protocol.MAX_LINE + 1)
        except OSError as e:  # TimeoutError too
            raise AgentError(f"agent {self.url}: no answer to hello ({e.strerror or e})") from None
        if not line:
            raise AgentError(f"agent {self.url}: connection lost (closed by the agent)")
        try:
            ans = protocol.decode(line)
        except ProtocolError as e:
            raise AgentError(f"agent {self.url}: protocol: {e}") from None
        if ans.kind == "error":
            raise _error(ans)
        return ans

    # ---- requests ------------------------------------------------------------
    def request(
        self,
        kind: str,
        *,
        timeout: float = REQUEST_TIMEOUT_S,
        on_data: Callable[[Message], None] | None = None,
        **body: Any,
    ) -> Message:
        """One request, its one answer. With on_data (a pull), the data
        events before the answer go to it, and `timeout` is the longest
        wait without one."""
        progress = [time.monotonic()]
        with self._plock:
            mid = self._next
            self._next += 1
            slot: tuple[threading.Event, list[Message]] = (threading.Event(), [])
            self._pending[mid] = slot
            if on_data is not None:

                def sink(m: Message) -> None:
                    progress[0] = time.monotonic()
                    on_data(m)

                self._pulls[mid] = sink
        try:
            self._send(protocol.encode(kind, mid, **body))
            while not slot[0].wait(min(timeout, 1.0)):
                if time.monotonic() - progress[0] >= timeout:
                    raise AgentError(f"agent {self.url}: no answer to {kind} within {timeout:g}s")
        finally:
            with self._plock:
                self._pending.pop(mid, None)
                self._pulls.pop(mid, None)
        if not slot[1]:
            raise AgentError(f"agent {self.url}: connection lost ({self.lost or 'closed'})")
        ans = slot[1][0]
        if ans.kind == "error":
            raise _error(ans)
        return ans

    def _send(self, data: bytes) -> None:
        if self._closed.is_set():
            raise AgentError(f"agent {self.url}: connection lost ({self.lost or 'closed'})")
        with self._wlock:
            try:
                self.sock.sendall(data)
            except OSError as e:
                raise AgentError(f"agent {self.url}: {e.strerror or e}") from None

    def arm(
        self,
        spec: Any,
        target: Target | int,
        *,
        duration: float,
        lease_s: float = 10.0,
        on_fire: Callable[[Fire], None] | None = None,
        timeout: float = ARM_TIMEOUT_S,
    ) -> RemoteSession:
        """Arm `spec` (a FaultSpec or several) in a process of the agent's
        node; returns once every probe is attached there. `duration` is the
        fault's kernel-side deadline (required); `lease_s` its dead-man lease."""
        # lazy: pyctl.spec (+19 modules) only when this runs
        from pyctl.spec import FaultSpec

        specs = [spec] if isinstance(spec, FaultSpec) else list(spec)
        if not specs or not all(isinstance(s, FaultSpec) for s in specs):
            raise BadInput("arm: give one FaultSpec or several (gpufault.Fault...)")
        tgt = Target.of(target)
        ans = self.request("arm", timeout=timeout, specs=[s.to_json() for s in specs],
                           target=tgt.to_json(), duration=duration, lease_s=lease_s)  # fmt: skip
        h = RemoteSession(self, ans, on_fire)
        with self._plock:
            self._sessions[h.session] = h
            early = self._early.pop(h.session, [])
        for m in early:
            h._event(m)
        return h

    def status(self) -> dict[str, Any]:
        return dict(self.request("status").body)

    def pull_evidence(
        self, into: str | os.PathLike[str], *, idle_timeout: float = PULL_IDLE_S
    ) -> dict[str, Any]:
        """The agent's evidence store, one consistent snapshot, written to
        `into`: a new file (O_EXCL, never a link followed, 0600). Checked
        against the agent's size and sha256; on any failure the file is
        removed. Returns the agent's facts (bytes, sha256, runs, running)."""
        fd = os.open(into, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)  # fmt: skip
        h = hashlib.sha256()
        state: dict[str, Any] = {"seq": 0, "bytes": 0, "error": ""}

        def chunk(m: Message) -> None:  # on the reader thread
            if state["error"]:
                return
            if m.get("seq") != state["seq"]:
                state["error"] = f"chunk {m.get('seq')} where {state['seq']} was due"
                return
            try:
                data = base64.b64decode(str(m.get("b64")), validate=True)
            except (binascii.Error, ValueError):
                state["error"] = f"chunk {state['seq']} is not base64"
                return
            h.update(data)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            state["seq"] += 1
            state["bytes"] += len(data)

        ok = False
        try:
            ans = self.request("pull", timeout=idle_timeout, on_data=chunk)
            facts = dict(ans.body)
            if state["error"]:
                raise AgentError(f"agent {self.url}: pull: {state['error']}")
            if state["bytes"] != facts.get("bytes") or h.hexdigest() != facts.get("sha256"):
                raise AgentError(f"agent {self.url}: pull: got {state['bytes']} bytes, sha256 "
                                 f"{h.hexdigest()[:12]}, the agent sent {facts.get('bytes')} "
                                 f"({str(facts.get('sha256'))[:12]}): pull again")  # fmt: skip
            os.fsync(fd)
            ok = True
            return facts
        finally:
            os.close(fd)
            if not ok:
                os.unlink(into)

    def sessions(self) -> list[dict[str, Any]]:
        return list(self.request("sessions").get("sessions") or [])

    def close(self, disarm: bool = True) -> None:
        """Disarm what this client armed (disarm=False: leave them to their
        leases), then close the connection."""
        if disarm:
            for h in list(self._sessions.values()):
                try:
                    h.disarm()
                except GpufaultError:
                    pass
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(5)

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- threads ---------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                line = self._f.readline(protocol.MAX_LINE + 1)
                if not line:
                    self.lost = self.lost or "closed by the agent"
                    break
                try:
                    msg = protocol.decode(line)
                except ProtocolError as e:
                    self.lost = f"protocol: {e}"
                    break
                self._on(msg)
        except (OSError, ValueError) as e:
            self.lost = self.lost or str(e)
        finally:
            self._closed.set()
            with self._plock:
                pending = list(self._pending.values())
                sessions = list(self._sessions.values())
            for ev, _box in pending:
                ev.set()  # answered with nothing: connection lost
            for h in sessions:
                # Its lease runs out at the agent: the fault is off or will be.
                h.renewing = False

    def _on(self, msg: Message) -> None:
        if msg.kind == "data":
            with self._plock:
                sink = self._pulls.get(msg.get("pull"))  # type: ignore[arg-type]
            if sink is not None:
                sink(msg)
            return
        if msg.kind in protocol.ANSWERS:
            with self._plock:
                slot = self._pending.get(msg.id) if msg.id is not None else None
            if slot is not None:
                slot[1].append(msg)
                slot[0].set()
            elif msg.kind == "error":  # a refusal with no id (the agent closes next)
                self.lost = str(msg.get("message"))
                with self._plock:
                    pending = list(self._pending.values())
                for ev, box in pending:
                    box.append(msg)
                    ev.set()
            return
        sid = str(msg.get("session"))
        with self._plock:
            h = self._sessions.get(sid)
            if h is None:
                self._early.setdefault(sid, []).append(msg)
                return
        h._event(msg)

    def _renew_loop(self) -> None:
        while not self._closed.is_set():
            now = time.monotonic()
            nxt = now + 1.0
            with self._plock:
                live = [h for h in self._sessions.values() if h.renewing]
            for h in live:
                due = h.last_renewal + h.lease_s / 3
                if due <= now:
                    threading.Thread(target=self._renew_one, args=(h,), daemon=True,
                                     name="gf-agent-renew1").start()  # fmt: skip
                    h.last_renewal = now  # the next one is due lease/3 from now
                    due = now + h.lease_s / 3
                nxt = min(nxt, due)
            self._closed.wait(max(nxt - time.monotonic(), 0.005))

    def _renew_one(self, h: RemoteSession) -> None:
        try:
            h.renew()
        except GpufaultError:
            pass


def _connect_unix(path: str, timeout: float) -> socket.socket:
    d, name = os.path.split(os.path.abspath(path))
    try:
        dfd = rundir.open_dir(d, create=False, owner=0)
    except (rundir.UnsafeRunDir, FileNotFoundError) as e:
        raise AgentError(f"agent unix:{path}: {e}") from None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        rundir.connect_root(s, dfd, name, timeout_s=timeout)
    except rundir.UntrustedPeer as e:
        s.close()
        raise AgentRefused(f"agent unix:{path}: {e}: nothing sent") from None
    except OSError as e:
        s.close()
        raise AgentError(f"agent unix:{path}: {e.strerror or e}") from None
    finally:
        os.close(dfd)
    s.settimeout(timeout)
    return s


def _connect_tls(
    url: str, cert: str | None, key: str | None, ca: str | None, hostname: str | None,
    timeout: float,
) -> socket.socket:  # fmt: skip
    # lazy: the server module's parser is the one reading of a tls:// address
    from pyctl.agent.server import Listen

    x = Listen.parse(url)
    ctx = auth.client_context(ca, cert, key)
    try:
        raw = socket.create_connection((x.host, x.port), timeout=timeout)
    except OSError as e:
        raise AgentError(f"agent {url}: {e.strerror or e}") from None
    try:
        return ctx.wrap_socket(raw, server_hostname=hostname or x.host)
    except (OSError, ValueError) as e:
        raw.close()
        raise AgentRefused(f"agent {url}: TLS: {getattr(e, 'reason', None) or e}") from None


def connect(url: str, **kw: Any) -> AgentClient:
    return AgentClient.connect(url, **kw)


__all__ = ["AgentClient", "AgentError", "AgentRefused", "RemoteSession", "connect"]
