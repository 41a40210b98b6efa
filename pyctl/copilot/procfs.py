"""What /proc says about a target: its threads, their states, its tracer."""

from __future__ import annotations

import os
from pathlib import Path


def status(pid: int, tid: int | None = None) -> dict[str, str]:
    """/proc/PID/status (or PID/task/TID/status) as a dict; raises OSError."""
    path = Path(f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status")
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def tracer_pid(pid: int, tid: int | None = None) -> int:
    return int(status(pid, tid).get("TracerPid", "0"))


def tids(pid: int) -> list[int]:
    """Thread ids of pid now (threads may come and go while we look)."""
    try:
        return sorted(int(name) for name in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return []


def thread_state(pid: int, tid: int) -> str:
    """One letter from /proc/PID/task/TID/stat: R S D T t Z X ..."""
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    # comm may hold spaces and parentheses: the state follows the last ')'.
    return stat[stat.rindex(")") + 2]


def ptrace_scope() -> int | None:
    """kernel.yama.ptrace_scope, or None without Yama."""
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (FileNotFoundError, ValueError):
        return None
