"""The HTTP front end: stdlib ThreadingHTTPServer, one thread per connection.

Routes: POST /v1/completions, GET /health, GET /metrics (and with
--perturb-control GET/POST/DELETE /admin/perturb). HTTP/1.1 with
keep-alive (a load generator at hundreds of requests/s should not pay a
TCP handshake per request); every answer has a Content-Length, and every
error body is one line of JSON: {"error": {"type": ..., "message": ...}}.

Hostile or broken clients (docs/service.md, "Input handling"): at most
--max-connections handler threads (a connection past them is answered 503
and closed by the accepting thread); every read is bounded by a deadline
for its phase (--idle-timeout for a kept-alive connection's next request,
--header-timeout for the request line and headers once the first byte is
in, --body-timeout for the body): 408, then close. A Content-Length that
is not a decimal number is 400, one over MAX_BODY is 413, JSON nested
deeper than the parser's limit is 400; a client that went away is not an
error of the service (no traceback, nothing on stderr).
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
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pyctl.service.app import Service, log
from pyctl.service.batcher import error_body
from pyctl.service.metrics import CONTENT_TYPE
from pyctl.service.perturb import PerturbError

MAX_BODY = 1 << 20  # a completion request is a prompt, not an upload
PERTURB = "/admin/perturb"  # --perturb-control (pyctl/service/perturb.py)
# ASCII digits only: str.isdigit() also takes "²" and "١", which int()
# then refuses (or reads): the traceback and dropped connection of issue 25.
_LENGTH = re.compile(r"[0-9]+")
WRITE_TIMEOUT = 10.0  # an answer the client does not read for this long is dropped


class _Deadline(io.RawIOBase):
    """The connection's reads, each bounded by what is left of the current
    phase's deadline. A socket timeout alone is per recv(): a client that
    sends one byte every few seconds would hold its thread forever."""

    def __init__(self, sock: socket.socket, handler: Handler) -> None:
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


class ServiceHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client must not keep the process alive
    allow_reuse_address = True
    # listen() backlog: the stdlib's 5 drops SYNs of a burst of clients, and
    # a dropped SYN is retried after 1 s: a p99 of exactly 1 s that is the
    # kernel's, not the service's.
    request_queue_size = 256

    def __init__(self, addr: tuple[str, int], service: Service) -> None:
        self.service = service
        self.limits = service.cfg
        self._slots = threading.BoundedSemaphore(service.cfg.max_connections)
        super().__init__(addr, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # A thread per connection, but no more than max_connections of
        # them: past that, the accepting thread answers 503 itself.
        if not self._slots.acquire(blocking=False):
            self._refuse_connection(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # no thread started: no one else releases it
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

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
        self.service.metrics.errors.labels(kind="shed", code="connections").inc()
        self.shutdown_request(sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A handler's unexpected exception: one line, never a traceback
        (the stdlib prints one per connection to stderr)."""
        e = sys.exc_info()[1]
        if isinstance(e, (ConnectionError, TimeoutError)):
            return  # the client went away or stalled: its business

        log(f"HTTP handler failed for {client_address[0]}: {type(e).__name__}: {e}")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: with Nagle on, the body waits
    # for the client's delayed ACK (up to 40 ms), which the load
    # generator's p99 then shows as the service's latency.
    disable_nagle_algorithm = True
    server: ServiceHTTPServer
    server_version = "gf-service/0.1"

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

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        svc = self.server.service
        if path == "/health":
            status, body = svc.health()
            self._json(status, body)
        elif path == "/metrics":
            self._send(200, svc.metrics.render(), CONTENT_TYPE)
        elif path == "/v1/completions":
            self._json(
                405, error_body("method_not_allowed", "use POST /v1/completions"), {"Allow": "POST"}
            )
        elif path == PERTURB:
            self._perturb("GET")
        else:
            self._not_found()

    def do_DELETE(self) -> None:
        if self.path.split("?", 1)[0] == PERTURB:
            self._perturb("DELETE")
        else:
            self._drain()
            self._not_found()

    def _perturb(self, method: str, body: Any = None) -> None:
        """/admin/perturb (pyctl/service/perturb.py): arm, read, end."""
        ctl = self.server.service.perturb
        if ctl is None:
            self._json(
                404,
                error_body(
                    "not_found",
                    f"{PERTURB} is closed: start the service with --perturb-control",
                ),
            )
            return
        peer = f"{self.client_address[0]}:{self.client_address[1]}"
        denied = ctl.deny(self.headers.get("Authorization"), peer, method)
        if denied is not None:
            self._json(401, error_body("unauthorized", denied), {"WWW-Authenticate": "Bearer"})
            return
        if method == "POST":
            try:
                self._json(200, ctl.arm(body, peer))
            except PerturbError as e:
                busy = "is active" in str(e)
                self._json(409 if busy else 400, error_body("invalid_request_error", str(e)))
            return
        rep = ctl.status() if method == "GET" else ctl.disarm(peer)
        if rep is None:
            self._json(404, error_body("not_found", f"nothing was armed: POST {PERTURB} first"))
        else:
            self._json(200, rep)

    def do_POST(self) -> None:
        t0 = time.monotonic()
        path = self.path.split("?", 1)[0]
        if path == PERTURB:
            self._perturb_post()
            return
        if path != "/v1/completions":
            self._drain()
            self._not_found()
            return
        svc = self.server.service
        raw = self._body(t0)
        if raw is None:
            return  # answered: 400, 408 or 413
        body, bad = _loads(raw)
        out = svc.bad_request(bad, t0) if bad is not None else svc.complete(body, t0)
        self._json(out.status, out.body, out.headers)

    def _perturb_post(self) -> None:
        raw = self._body(None)
        if raw is None:
            return
        body, bad = _loads(raw)
        if bad is not None:
            self._json(400, error_body("invalid_request_error", bad))
            return
        self._perturb("POST", body)

    def _refuse(self, status: int, message: str, t0: float | None) -> None:
        """A request the transport refuses (400, 408, 413); one of
        /v1/completions (t0 given) is counted like the service's own."""
        svc = self.server.service
        if t0 is None:
            kind = "request_timeout" if status == 408 else "invalid_request_error"
            self._json(status, error_body(kind, message))
            return
        out = svc.bad_request(message, t0) if status == 400 else svc.refused(status, message, t0)
        self._json(out.status, out.body, out.headers)

    def _body(self, t0: float | None) -> bytes | None:
        """The request's body (Content-Length bytes, within --body-timeout),
        or None once the refusal is answered; every refusal closes the
        connection (where the next request would start is unknown)."""
        n = self.headers.get("Content-Length")
        if n is None or not _LENGTH.fullmatch(n.strip()):
            self.close_connection = True
            self._refuse(400, "a Content-Length header with a decimal number is needed", t0)
            return None
        # More digits than any allowed size: over the limit, and int() would
        # refuse 4,300 of them (Python's int max_str_digits).
        size = int(n) if len(n.strip()) <= 16 else MAX_BODY + 1
        if size > MAX_BODY:
            self.close_connection = True
            self._refuse(413, f"body of {size} bytes is over {MAX_BODY}: send less", t0)
            return None
        limit = self.server.limits.body_timeout_s
        self.phase, self.deadline = "body", time.monotonic() + limit
        try:
            raw = self.rfile.read(size)
        except TimeoutError:
            self.close_connection = True
            self._refuse(408, f"the body ({size} bytes) did not arrive within {limit:g}s", t0)
            return None
        if len(raw) < size:  # the client shut its side down early
            self.close_connection = True
            self._refuse(400, f"the body ended after {len(raw)} of {size} bytes", t0)
            return None
        return raw

    def _drain(self) -> None:
        """Read (and drop) the body of a request answered without it, so
        that the connection can carry the next request; else close it."""
        n = self.headers.get("Content-Length")
        if n is None or not _LENGTH.fullmatch(n.strip()) or len(n.strip()) > 16:
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

    def _not_found(self) -> None:
        self._json(
            404,
            error_body(
                "not_found",
                f"no route {self.path}: POST /v1/completions, GET /health, GET /metrics"
                + (f", {PERTURB}" if self.server.service.perturb is not None else ""),
            ),
        )


def _loads(raw: bytes) -> tuple[Any, str | None]:
    """(body, None), or (None, why it is not JSON we take)."""
    try:
        return json.loads(raw), None
    except RecursionError:
        # The C parser counts its nesting against the recursion limit and
        # raises cleanly; uncaught, the handler thread died with a traceback.
        return None, "invalid JSON: nested too deeply (a completion request is a flat object)"
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"invalid JSON: {str(e).splitlines()[0]}"
