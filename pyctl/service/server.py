"""The HTTP front end: stdlib ThreadingHTTPServer, one thread per connection.

Routes: POST /v1/completions, GET /health, GET /metrics (and with
--perturb-control GET/POST/DELETE /admin/perturb). HTTP/1.1 with
keep-alive (a load generator at hundreds of requests/s should not pay a
TCP handshake per request); every answer has a Content-Length, and every
error body is one line of JSON: {"error": {"type": ..., "message": ...}}.
"""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pyctl.service.app import Service
from pyctl.service.batcher import error_body
from pyctl.service.metrics import CONTENT_TYPE

MAX_BODY = 1 << 20  # a completion request is a prompt, not an upload
PERTURB = "/admin/perturb"  # --perturb-control (pyctl/service/perturb.py)


class ServiceHTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client must not keep the process alive
    allow_reuse_address = True
    # listen() backlog: the stdlib's 5 drops SYNs of a burst of clients, and
    # a dropped SYN is retried after 1 s: a p99 of exactly 1 s that is the
    # kernel's, not the service's.
    request_queue_size = 256

    def __init__(self, addr: tuple[str, int], service: Service) -> None:
        self.service = service
        super().__init__(addr, Handler)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: with Nagle on, the body waits
    # for the client's delayed ACK (up to 40 ms), which the load
    # generator's p99 then shows as the service's latency.
    disable_nagle_algorithm = True
    server: ServiceHTTPServer
    server_version = "gf-service/0.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown stderr at load; /metrics counts them

    def _send(self, status: int, body: bytes, ctype: str, headers: dict[str, str] | None = None):
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
        from pyctl.service.perturb import PerturbError

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
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True  # the body's end is unknown
            out = svc.bad_request("a Content-Length header is needed", t0)
        elif int(length) > MAX_BODY:
            self.close_connection = True
            out = svc.bad_request(f"body over {MAX_BODY} bytes", t0)
        else:
            raw = self.rfile.read(int(length))
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                out = svc.bad_request(f"invalid JSON: {str(e).splitlines()[0]}", t0)
            else:
                out = svc.complete(body, t0)
        self._json(out.status, out.body, out.headers)

    def _perturb_post(self) -> None:
        n = self.headers.get("Content-Length")
        if n is None or not n.isdigit() or int(n) > MAX_BODY:
            self.close_connection = True
            self._json(
                400, error_body("invalid_request_error", "a Content-Length header is needed")
            )
            return
        try:
            body = json.loads(self.rfile.read(int(n)))
        except (ValueError, UnicodeDecodeError) as e:
            self._json(400, error_body("invalid_request_error", f"invalid JSON: {e}"))
            return
        self._perturb("POST", body)

    def _drain(self) -> None:
        n = self.headers.get("Content-Length")
        if n and n.isdigit() and int(n) <= MAX_BODY:
            self.rfile.read(int(n))
        else:
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
