"""Reading a controller's output line by line, then the rest, without losing
lines in between.

Popen.communicate(timeout=...) reads the raw pipe descriptors, so whatever a
readline() on the same pipe had already buffered is dropped. A test that
waits for "Ctrl-C to end" with readline() and then calls communicate() loses
the lines printed just after it (the probes, the warnings) whenever the
controller printed them before the test read the pipe: on a loaded machine,
often. These helpers read through the buffered objects instead.

start_controller() starts one and returns once it printed its start-up line
(a controller prints it only after attaching), with the lines up to it.
start_ready() does the same through `--ready-fd` (the one signal under -q,
which prints no start-up line).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
from collections.abc import Sequence
from typing import IO, Any


def _read_until(stream: IO[str] | None, marker: str) -> list[str]:
    """Lines up to and including the first one that holds `marker`, or all
    of them when the stream ends first (then the last lacks the marker)."""
    assert stream is not None
    seen: list[str] = []
    while ln := stream.readline():
        seen.append(ln)
        if marker in ln:
            break
    return seen


def lines_until(stream: IO[str] | None, marker: str) -> list[str]:
    """Lines up to and including the first one that holds `marker`; fails
    with what was read when the stream ends first."""
    seen = _read_until(stream, marker)
    assert seen and marker in seen[-1], f"output ended before {marker!r}: {''.join(seen)}"
    return seen


def start_controller(
    argv: Sequence[str], marker: str = "Ctrl-C to end", **popen_kw: Any
) -> tuple[subprocess.Popen[str], list[str]]:
    """Start argv (stderr a text pipe; popen_kw as for Popen: cwd, env,
    stdout, preexec_fn...) and return it once its stderr printed a line that
    holds `marker`, with the lines up to and including that one. The rest of
    stderr stays in the pipe for readline() or finish(). Fails with the exit
    status and what it printed when it ends first."""
    own = list(argv)[: list(argv).index("--")] if "--" in argv else list(argv)
    assert not {"-q", "--quiet"} & set(own), "-q prints no start-up line: use start_ready()"
    proc = subprocess.Popen(list(argv), stderr=subprocess.PIPE, text=True, **popen_kw)
    lines = _read_until(proc.stderr, marker)
    if lines and marker in lines[-1]:
        return proc, lines
    # stderr is at EOF: the process is exiting, so its status is the clue.
    # One that closed stderr and runs on is killed, not left to the test run.
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    raise AssertionError(f"{shlex.join(argv)} exited {code} before {marker!r}:\n{''.join(lines)}")


def start_ready(argv: Sequence[str], **popen_kw: Any) -> tuple[subprocess.Popen[str], str]:
    """Start a trace/inject/template run argv with `--ready-fd N` (a pipe;
    put before a `-- CMD`) and return it, with its run id, once it wrote
    `ready RUN` there (every probe live). stderr is a text pipe, left
    unread for readline() or finish(). Fails with the exit status and what
    it printed when the descriptor closes without the line."""
    r, w = os.pipe()
    args = list(argv)
    at = args.index("--") if "--" in args else len(args)
    args[at:at] = ["--ready-fd", str(w)]
    try:
        proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, pass_fds=(w,), **popen_kw)
    finally:
        os.close(w)
    with os.fdopen(r) as ready:
        line = ready.readline()
    if line.startswith("ready ") and line.endswith("\n"):
        return proc, line.split()[1]
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    assert proc.stderr is not None
    raise AssertionError(
        f"{shlex.join(args)} exited {code} before it was ready ({line!r}):\n{proc.stderr.read()}"
    )


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
