"""The HTTP front end: stdlib ThreadingHTTPServer, one thread per connection.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /health,
GET /metrics (and with --perturb-control GET/POST/DELETE /admin/perturb).
A completion or chat request with "stream": true is answered with
Server-Sent Events (text/event-stream, chunked): `data: {chunk}` per token
as the worker makes it, then `data: [DONE]`. HTTP/1.1 with
keep-alive (a load generator at hundreds of requests/s should not pay a
TCP handshake per request); every answer has a Content-Length, and every
error body is one line of JSON: {"error": {"type": ..., "message": ...}}.

Hostile or broken clients (docs/service.md, "Input handling"): the
transport (threads, deadlines, JSON refusals) is pyctl/service/httpbase.py,
shared with rank 1's /metrics; here: at most
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

import json
import time
from typing import Any

from pyctl.service.app import Service, Stream, log
from pyctl.service.batcher import error_body
from pyctl.service.httpbase import (
    LENGTH,
    MAX_BODY,
    WRITE_TIMEOUT,
    BoundedHandler,
    BoundedHTTPServer,
)
from pyctl.service.metrics import CONTENT_TYPE
from pyctl.service.perturb import PerturbError

PERTURB = "/admin/perturb"  # --perturb-control (pyctl/service/perturb.py)
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


class ServiceHTTPServer(BoundedHTTPServer):
    """Rank 0's front end: the transport of pyctl/service/httpbase.py with
    the service's routes (Handler) and its shed-connection counter."""

    def __init__(self, addr: tuple[str, int], service: Service) -> None:
        self.service = service
        super().__init__(addr, Handler, service.cfg, log)

    def on_shed(self) -> None:
        self.service.metrics.errors.labels(kind="shed", code="connections").inc()


class Handler(BoundedHandler):
    server: ServiceHTTPServer
    server_version = "gf-service/0.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        svc = self.server.service
        if path == "/health":
            status, body = svc.health()
            self._json(status, body)
        elif path == "/metrics":
            self._send(200, svc.metrics.render(), CONTENT_TYPE)
        elif path in (COMPLETIONS, CHAT):
            self._json(405, error_body("method_not_allowed", f"use POST {path}"), {"Allow": "POST"})
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
        if path not in (COMPLETIONS, CHAT):
            self._drain()
            self._not_found()
            return
        svc = self.server.service
        raw = self._body(t0)
        if raw is None:
            return  # answered: 400, 408 or 413
        body, bad = _loads(raw)
        out = svc.bad_request(bad, t0) if bad is not None else svc.open(body, t0, chat=path == CHAT)
        if isinstance(out, Stream):
            self._events(out)
        else:
            self._json(out.status, out.body, out.headers)

    def _events(self, st: Stream) -> None:
        """Server-Sent Events in HTTP/1.1 chunks: one `data:` event per
        chunk object, flushed as it is made (the client's time to first
        token and gaps between tokens are the worker's), then [DONE]. A
        client that stops reading is dropped after WRITE_TIMEOUT."""
        self.phase = "nothing"
        self.connection.settimeout(WRITE_TIMEOUT)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        w = self.wfile
        try:
            for obj in st.chunks():
                ev = b"data: " + json.dumps(obj).encode() + b"\n\n"
                w.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                w.flush()
            done = b"data: [DONE]\n\n"
            w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            w.flush()
        except (ConnectionError, TimeoutError):
            self.close_connection = True

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
        if n is None or not LENGTH.fullmatch(n.strip()):
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

    def _not_found(self) -> None:
        self._json(
            404,
            error_body(
                "not_found",
                f"no route {self.path}: POST {COMPLETIONS}, POST {CHAT}, GET /health, GET /metrics"
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
