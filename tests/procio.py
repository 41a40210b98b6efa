"""Reading a controller's output line by line, then the rest, without losing
lines in between.

Popen.communicate(timeout=...) reads the raw pipe descriptors, so whatever a
readline() on the same pipe had already buffered is dropped. A test that
waits for "Ctrl-C to end" with readline() and then calls communicate() loses
the lines printed just after it (the probes, the warnings) whenever the
controller printed them before the test read the pipe: on a loaded machine,
often. These helpers read through the buffered objects instead.
"""

from __future__ import annotations

import subprocess
import threading
from typing import IO


def lines_until(stream: IO[str] | None, marker: str) -> list[str]:
    """Lines up to and including the first one that holds `marker`; fails
    with what was read when the stream ends first."""
    assert stream is not None
    seen: list[str] = []
    while True:
        ln = stream.readline()
        assert ln, f"output ended before {marker!r}: {''.join(seen)}"
        seen.append(ln)
        if marker in ln:
            return seen


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """The rest of stdout and stderr (each '' when not a pipe) and the exit,
    like communicate(timeout=...), but keeping what readline() buffered. Past
    the timeout the process is killed and TimeoutExpired is raised."""
    got: dict[str, str] = {}

    def read(name: str, stream: IO[str] | None) -> None:
        got[name] = stream.read() if stream is not None else ""

    readers = [
        threading.Thread(target=read, args=(name, stream), daemon=True)
        for name, stream in (("out", proc.stdout), ("err", proc.stderr))
    ]
    for t in readers:
        t.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        for t in readers:
            t.join(timeout=10)  # EOF follows the exit, unless a child holds the pipe
    return got.get("out", ""), got.get("err", "")
