"""The node agent's accepting loop (pyctl/agent/server.py _accept): a
connection whose thread cannot be started (RuntimeError: can't start new
thread) gives back its slot and its socket, and the loop goes on to the
next connection. Before, the slot leaked (MAX_CONNECTIONS of them and the
agent answered no one) and the exception ended the accepting thread."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from pyctl.agent import server as S


class _Listener:
    """accept() hands out the given sockets, then fails as a closed one does."""

    def __init__(self, socks: list[socket.socket]) -> None:
        self.socks = socks

    def accept(self) -> tuple[socket.socket, str]:
        if not self.socks:
            raise OSError("closed")
        return self.socks.pop(0), ""


def test_a_thread_that_cannot_start_gives_back_its_slot_and_socket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    srv = S.AgentServer([f"unix:{tmp_path}/a.sock"], db=str(tmp_path / "gf.db"))
    pairs = [socket.socketpair() for _ in range(S.MAX_CONNECTIONS + 2)]
    served: list[socket.socket] = []
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name == "gf-agent-conn" and len(served) < S.MAX_CONNECTIONS + 1:
            served.append(self._args[0])  # type: ignore[attr-defined]
            raise RuntimeError("can't start new thread")
        real_start(self)

    def serve(self: S.AgentServer, c: socket.socket, x: object, addr: object) -> None:
        c.close()  # the connection after the refusals: served (nothing to say)
        self._slots.release()

    monkeypatch.setattr(S.AgentServer, "_serve_conn", serve)
    monkeypatch.setattr(threading.Thread, "start", start)
    try:
        srv._accept(_Listener([a for a, _ in pairs]), srv.listens[0])  # type: ignore[arg-type]
        for t in threading.enumerate():
            if t.name == "gf-agent-conn":
                t.join(10)
        monkeypatch.undo()
        # Every refused connection's socket closed, and every slot free again
        # (more refusals than slots: a leak would have run out of them).
        assert len(served) == S.MAX_CONNECTIONS + 1
        assert all(c.fileno() == -1 for c in served)
        for _ in range(S.MAX_CONNECTIONS):
            assert srv._slots.acquire(blocking=False)
    finally:
        srv.close()
        for a, b in pairs:
            a.close()
            b.close()
