"""The reference service's accepting thread (pyctl/service/httpbase.py):
a connection's thread slot is released exactly once, even when the
serving thread is interrupted (SIGTERM's exception) while Thread.start()
waits for a handler thread that has already run and released it.
Before, the second release raised BoundedSemaphore's ValueError in place
of the interruption: the service logged "Semaphore released too many
times" and did not stop on SIGTERM (tests/test_service_ranks.py saw it
killed at close)."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import pytest

from pyctl.service.httpbase import BoundedHandler, BoundedHTTPServer


class _Handler(BoundedHandler):
    def do_GET(self) -> None:  # pragma: no cover - the test sends nothing
        self.send_error(404)


def _server() -> BoundedHTTPServer:
    limits = SimpleNamespace(
        max_connections=2, idle_timeout_s=1.0, header_timeout_s=1.0, body_timeout_s=1.0
    )
    return BoundedHTTPServer(("127.0.0.1", 0), _Handler, limits, lambda line: None)


def test_an_interrupted_start_after_the_thread_ran_releases_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    srv = _server()
    real_start = threading.Thread.start

    def start_then_interrupt(self: threading.Thread) -> None:
        real_start(self)
        self.join(10)  # the handler ran to its end and released its slot
        raise KeyboardInterrupt  # what a signal handler raises into start()'s wait

    ours, theirs = socket.socketpair()
    theirs.close()  # the handler reads EOF at once
    try:
        monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            srv.process_request(ours, ("127.0.0.1", 1))
        monkeypatch.undo()
        # Both slots free again, and no third one: released once, not twice.
        assert srv._slots.acquire(blocking=False) and srv._slots.acquire(blocking=False)
        assert not srv._slots.acquire(blocking=False)
    finally:
        srv.server_close()
        ours.close()


def test_a_start_refused_before_the_thread_ran_frees_the_slot_and_the_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    srv = _server()

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    ours, theirs = socket.socketpair()
    try:
        monkeypatch.setattr(threading.Thread, "start", refuse)
        with pytest.raises(RuntimeError):
            srv.process_request(ours, ("127.0.0.1", 1))
        monkeypatch.undo()
        assert ours.fileno() == -1  # closed by shutdown_request
        assert srv._slots.acquire(blocking=False) and srv._slots.acquire(blocking=False)
    finally:
        srv.server_close()
        theirs.close()
