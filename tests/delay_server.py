"""A stdlib HTTP server of known delay, for the load generator's tests and bench.

Every request (any method, any path but /log) is answered 200 after
`delay` seconds, or after `stall_delay` if it arrived inside a stall
window [stall_at, stall_at + stall_for) (time.time() values), or with
`status` when set. HTTP/1.1 keep-alive, one thread per connection. It
records for each request when it arrived (the kernel's receive stamp)
and how long until its answer was written (sleep overshoot and this
server's own scheduling included): the truth the generator's numbers are
checked against. GET /log returns those records as JSON.

In-process (tests)::

    srv = DelayServer(delay=0.02); srv.start(); ... srv.url ...; srv.close()

As a process (the bench, so that it does not share the generator's GIL)::

    python3 tests/delay_server.py --delay 0.02 --stall-at T --stall-for 1 --stall-delay 0.2
    # prints "PORT" on stdout once listening; SIGTERM ends it
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, and each answer written with one send: a header segment
    # followed by a body segment under Nagle waits for the client's delayed
    # ACK, up to 40 ms, which is the server's latency, not the delay asked for.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)

    def handle_one_request(self) -> None:
        # When the request reached this host (the kernel's stamp, peeked
        # before reading): the truth starts there, not when a thread of
        # this server got around to it.
        self.arrival = time.time()
        try:
            _d, anc, _f, _a = self.connection.recvmsg(1, socket.CMSG_SPACE(16), socket.MSG_PEEK)
        except OSError:
            anc = []
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
                sec, nsec = struct.unpack("qq", raw[:16])
                self.arrival = sec + nsec * 1e-9
        super().handle_one_request()

    def _answer(self) -> None:
        t_recv = self.arrival
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        if self.path.startswith("/log"):
            with self.server.lock:
                body = json.dumps(self.server.log).encode()
            self._send(200, body)
            return
        srv = self.server.owner
        d = srv.delay
        if srv.stall_for and srv.stall_at <= t_recv < srv.stall_at + srv.stall_for:
            d = srv.stall_delay
        srv.entered.release()  # a request is in (before any gate holds it)
        if srv.gate is not None:
            srv.gate.wait()  # a test holds answers until it sets the event
        if d > 0:
            time.sleep(max(0.0, t_recv + d - time.time()))  # d from the arrival
        status = srv.status
        self._send(status, b'{"ok": true}\n' if status == 200 else b'{"error": "test"}\n')
        took = time.time() - t_recv  # arrival to answer written (loopback: delivered)
        with self.server.lock:
            self.server.log.append((t_recv, took))
        srv.arrived.release()

    def _send(self, status: int, body: bytes) -> None:
        head = (
            f"HTTP/1.1 {status} {self.responses.get(status, ('',))[0]}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.wfile.write(head.encode() + body)  # one send

    do_GET = do_POST = _answer


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256
    owner: DelayServer

    def __init__(self, addr: tuple[str, int]) -> None:
        super().__init__(addr, _Handler)
        self.lock = threading.Lock()
        self.log: list[tuple[float, float]] = []
        self.connections = 0  # accepted TCP connections (keep-alive reuses them)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            self.connections += 1
        super().process_request(request, client_address)


class DelayServer:
    def __init__(
        self,
        delay: float = 0.0,
        *,
        status: int = 200,
        stall_at: float = 0.0,
        stall_for: float = 0.0,
        stall_delay: float = 0.0,
        port: int = 0,
    ) -> None:
        self.delay, self.status = delay, status
        self.stall_at, self.stall_for, self.stall_delay = stall_at, stall_for, stall_delay
        self.gate: threading.Event | None = None
        self.arrived = threading.Semaphore(0)  # one release per answered request
        self.entered = threading.Semaphore(0)  # one release per request read
        self.httpd = _Server(("127.0.0.1", port))
        self.httpd.owner = self
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None

    @property
    def log(self) -> list[tuple[float, float]]:
        with self.httpd.lock:
            return list(self.httpd.log)

    def start(self) -> DelayServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self.gate is not None:
            self.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> DelayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--stall-at", type=float, default=0.0)
    ap.add_argument("--stall-for", type=float, default=0.0)
    ap.add_argument("--stall-delay", type=float, default=0.0)
    a = ap.parse_args()
    srv = DelayServer(
        a.delay, stall_at=a.stall_at, stall_for=a.stall_for, stall_delay=a.stall_delay
    )
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.httpd.shutdown).start())
    print(srv.port, flush=True)
    srv.httpd.serve_forever()
    srv.httpd.server_close()
    sys.exit(0)


if __name__ == "__main__":
    main()
