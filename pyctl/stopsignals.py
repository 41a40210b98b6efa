"""SIGTERM/SIGINT that stop something, handled off the signal handler.

A Python signal handler runs in the main thread between two bytecodes,
wherever that thread is: inside a `with lock:` of its own, or inside the
previous handler when a second signal follows the first (an experiment's
abort and its end each send SIGTERM to a step's controller). A handler
that then takes a lock the interrupted frame holds (Event.set does)
deadlocks the process with itself; the controller was SIGKILLed 7 s later
and its run row left `running` (seen 1 run in 4 of worker-hang-abort).
So the handler here only writes a byte to a pipe, which takes no lock,
and a daemon thread calls the stop function, once.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any


def on_stop_signals(
    stop: Callable[[], None],
    signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT),
    name: str = "gf-stop-signal",
) -> None:
    """Install handlers for `signals` (main thread only) that make a
    thread of their own call stop() at the first one; later ones are
    absorbed."""
    rfd, wfd = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(wfd, False)

    def handler(_signo: int, _frame: Any) -> None:
        try:
            os.write(wfd, b"x")
        except OSError:
            pass  # the pipe is full: the stop is on its way already

    def waiter() -> None:
        try:
            if os.read(rfd, 1):
                stop()
        except OSError:
            pass

    threading.Thread(target=waiter, name=name, daemon=True).start()
    for s in signals:
        signal.signal(s, handler)


__all__ = ["on_stop_signals"]
