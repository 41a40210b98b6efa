"""The HTTP transport every listener of the reference service uses: rank
0's front end (pyctl/service/server.py) and rank 1's /metrics
(pyctl/service/follower.py). What it owns is how a connection is held, not
what is answered:

- at most `max_connections` handler threads; a connection past them is
  answered 503 by the accepting thread, without blocking, and closed;
- every read is bounded by a deadline for its phase, not per recv() (a
  byte-a-second trickle does not extend it): `idle_timeout_s` for a
  kept-alive connection's next request, `header_timeout_s` for the request
  line and headers once the first byte is in (408, then close),
  `body_timeout_s` for a body; a write the client does not read for
  WRITE_TIMEOUT is dropped;
- the stdlib's own refusals (a malformed request line, too many headers)
  are one line of JSON; a client that went away is not an error (nothing
  on stderr); any other handler exception is one line, never a traceback.

The values come from ServiceConfig (`--max-connections`, `--idle-timeout`,
`--header-timeout`, `--body-timeout`: docs/service.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from pyctl.service.batcher import error_body

MAX_BODY = 1 << 20  # a completion request is a prompt, not an upload
# ASCII digits only: str.isdigit() also takes "²" and "١", which int()
# then refuses (or reads): the traceback and dropped connection of issue 25.
LENGTH = re.compile(r"[0-9]+")
WRITE_TIMEOUT = 10.0  # an answer the client does not read for this long is dropped


class Limits(Protocol):
    """What the transport reads of ServiceConfig."""

    max_connections: int
    idle_timeout_s: float
    header_timeout_s: float
    body_timeout_s: float


class _Deadline(io.RawIOBase):
    """The connection's reads, each bounded by what is left of the current
    phase's deadline. A socket timeout alone is per recv(): a client that
    sends one byte every few seconds would hold its thread forever."""

    def __init__(self, sock: socket.socket, handler: BoundedHandler) -> None:
        self.sock, self.h = sock, handler

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        h = self.h
        left = h.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{h.phase} deadline passed")
        self.sock.settimeout(left)
        n = self.sock.recv_into(b)
        if n and h.phase == "idle":
            # The next request's first byte: its line and headers get their own time.
            h.phase, h.deadline = "headers", time.monotonic() + h.server.limits.header_timeout_s
        return n


class _Slot:
    """One connection's hold on the server's thread slots, released once
    by whichever of the accepting thread and the handler thread gets there
    first."""

    def __init__(self, slots: threading.BoundedSemaphore) -> None:
        self._slots = slots
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            if not self._held:
                return
            self._held = False
        self._slots.release()


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client must not keep the process alive
    allow_reuse_address = True
    # listen() backlog: the stdlib's 5 drops SYNs of a burst of clients, and
    # a dropped SYN is retried after 1 s: a p99 of exactly 1 s that is the
    # kernel's, not the service's.
    request_queue_size = 256

    def __init__(
        self,
        addr: tuple[str, int],
        handler: type[BoundedHandler],
        limits: Limits,
        log: Callable[[str], None],
    ) -> None:
        self.limits = limits
        self.log = log
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        super().__init__(addr, handler)

    def on_shed(self) -> None:
        """A connection was refused (503) for want of a thread: counted by
        a subclass that has a series for it."""

    def process_request(self, request: Any, client_address: Any) -> None:
        # A thread per connection, but no more than max_connections of
        # them: past that, the accepting thread answers 503 itself.
        if not self._slots.acquire(blocking=False):
            self._refuse_connection(request)
            return
        slot = _Slot(self._slots)
        # daemon threads: ThreadingMixIn keeps no list of them to join
        t = threading.Thread(
            target=self._serve_one, args=(request, client_address, slot), daemon=True
        )
        try:
            t.start()
        except BaseException:
            # Refused, or interrupted while start() waited for the thread
            # (SIGTERM's exception arrives in this, the serving thread): the
            # thread may have run and released the slot already, and the
            # exception must go on (it ends the service), not become the
            # BoundedSemaphore's ValueError of a second release.
            slot.release()
            if t.ident is None:  # it never ran: nobody else closes the socket
                self.shutdown_request(request)
            raise

    def _serve_one(self, request: Any, client_address: Any, slot: _Slot) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            slot.release()

    def _refuse_connection(self, sock: socket.socket) -> None:
        """503 without a thread and without blocking the accept loop: the
        answer fits the socket's send buffer; what the client sent already
        is read first so that close() sends FIN, not RST (which would
        discard the answer)."""
        body = (
            json.dumps(
                error_body(
                    "overloaded",
                    f"{self.limits.max_connections} connections are open: retry later",
                )
            ).encode()
            + b"\n"
        )
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
        ).encode()
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.recv(65536)
            sock.send(head + body)
        self.on_shed()
        self.shutdown_request(sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A handler's unexpected exception: one line, never a traceback
        (the stdlib prints one per connection to stderr)."""
        e = sys.exc_info()[1]
        if isinstance(e, (ConnectionError, TimeoutError)):
            return  # the client went away or stalled: its business
        self.log(f"HTTP handler failed for {client_address[0]}: {type(e).__name__}: {e}")


class BoundedHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: with Nagle on, the body waits
    # for the client's delayed ACK (up to 40 ms), which the load
    # generator's p99 then shows as the service's latency.
    disable_nagle_algorithm = True
    server: BoundedHTTPServer

    phase = "idle"  # what the connection waits for: idle, headers, body, nothing
    deadline = 0.0  # time.monotonic() by which the wait must end

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown stderr at load; /metrics counts them

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_Deadline(self.connection, self))

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionError, TimeoutError):
            # A client that reset the connection or stopped reading our
            # answer: nothing to answer, nothing to log.
            self.close_connection = True

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()

    def handle_one_request(self) -> None:
        # The stdlib's, with a deadline per phase, and a 408 for a request
        # whose line or headers did not arrive in time (it closes silently).
        limits = self.server.limits
        self.phase, self.deadline = "idle", time.monotonic() + limits.idle_timeout_s
        self.requestline, self.request_version, self.command = "", self.protocol_version, ""
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return  # parse_request answered (send_error)
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"unsupported method {self.command!r}")
                return
            method()
            self.wfile.flush()
        except TimeoutError:
            self.close_connection = True
            if self.phase == "headers":  # idle: no request began, nothing to answer
                self._json(
                    408,
                    error_body(
                        "request_timeout",
                        "the request line and headers did not arrive within "
                        f"{limits.header_timeout_s:g}s",
                    ),
                )

    def send_error(self, code: int, message: str | None = None, explain: str | None = None):
        """The stdlib's refusals (a malformed request line, too many or too
        long headers) as one line of JSON like every other error."""
        self.close_connection = True
        self._json(code, error_body("invalid_request_error", message or HTTPStatus(code).phrase))

    def _send(self, status: int, body: bytes, ctype: str, headers: dict[str, str] | None = None):
        self.phase = "nothing"
        self.connection.settimeout(WRITE_TIMEOUT)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode() + b"\n", "application/json", headers)

    def _drain(self) -> None:
        """Read (and drop) the body of a request answered without it, so
        that the connection can carry the next request; else close it."""
        n = self.headers.get("Content-Length")
        if n is None or not LENGTH.fullmatch(n.strip()) or len(n.strip()) > 16:
            self.close_connection = True
            return
        if int(n) > MAX_BODY:
            self.close_connection = True
            return
        self.phase = "body"
        self.deadline = time.monotonic() + self.server.limits.body_timeout_s
        try:
            if len(self.rfile.read(int(n))) < int(n):
                self.close_connection = True
        except TimeoutError:
            self.close_connection = True


__all__ = [
    "LENGTH",
    "MAX_BODY",
    "WRITE_TIMEOUT",
    "BoundedHTTPServer",
    "BoundedHandler",
    "Limits",
]
