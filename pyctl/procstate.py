"""Is a process alive, and where in /proc to read it.

A process whose main thread called pthread_exit keeps running on its other
threads, but its thread-group leader, /proc/PID itself, is a zombie: state
Z, and no maps, exe, root or environ (they belong to a task with an mm).
A real zombie (exited, not reaped by its parent) has the same /proc/PID and
no live task at all. So the state of the process is the state of any live
thread in /proc/PID/task/*, and per-process files are read through one of
those threads (/proc/PID/task/TID/maps is the process's maps).

Imports nothing heavy: the start of `trace --pid` reads it.
"""

from __future__ import annotations

import os

DEAD_STATES = ("Z", "X", "x")


def thread_state(pid: int, tid: int) -> str | None:
    """One letter from /proc/PID/task/TID/stat (R S D T t Z X ...), None
    when that thread is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # comm may hold spaces and parentheses: the state follows the last ')'.
    i = stat.rfind(b")")
    return stat[i + 2 : i + 3].decode() if i >= 0 else None


def live_tid(pid: int) -> int | None:
    """A thread of pid that has not exited (the leader when it lives), or
    None when pid has no live thread (gone, or a zombie)."""
    st = thread_state(pid, pid)
    if st is not None and st not in DEAD_STATES:
        return pid
    try:
        names = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for name in sorted(names, key=int):
        tid = int(name)
        if tid != pid and (s := thread_state(pid, tid)) is not None and s not in DEAD_STATES:
            return tid
    return None


def alive(pid: int) -> bool:
    """pid runs code: some thread of it has not exited."""
    return live_tid(pid) is not None


def is_zombie(pid: int) -> bool:
    """/proc/PID exists but no thread of it runs: exited, not yet reaped."""
    return os.path.exists(f"/proc/{pid}") and live_tid(pid) is None


def proc_dir(pid: int) -> str:
    """Where pid's per-process files (maps, exe, root, environ) can be read:
    /proc/PID, or /proc/PID/task/TID of a live thread when the leader has
    exited (pthread_exit in main). /proc/PID when nothing lives (the caller
    then finds the files empty or gone, as for an exited process)."""
    tid = live_tid(pid)
    return f"/proc/{pid}" if tid is None or tid == pid else f"/proc/{pid}/task/{tid}"


def parent(pid: int) -> int | None:
    """PPid of pid, None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return None
