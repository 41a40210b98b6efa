"""Drive build/targets/gf_target (a real process with a real shared library
of known behaviour) from tests: commands on stdin, results on stdout."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "build" / "targets" / "gf_target"
LIB = REPO / "build" / "targets" / "libgftarget.so"
LINE = re.compile(r"t=(\d+) tid=(\d+) i=(\d+) ret=(-?\d+) out=(-?\d+)")
ALLOC = re.compile(r"alloc i=(\d+) ret=(-?\d+) ptr=(\S+)")


class Target:
    def __init__(self, exe: str | Path = TARGET, env: dict[str, str] | None = None,
                 prefix: Sequence[str] = ()) -> None:  # fmt: skip
        """exe: the program to run (a link to gf_target names the process
        after the link); prefix: a wrapper's argv (unshare ...) before it."""
        self.p = subprocess.Popen(
            [*prefix, str(exe)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            bufsize=1, env=env,
        )  # fmt: skip
        assert self.p.stdout is not None
        first = self.p.stdout.readline()
        assert first.startswith("ready"), first
        self.pid = self.p.pid
        if prefix:
            # `unshare --fork` runs gf_target as its child: that is the target.
            from pyctl.targets.procfs import descendants

            self.pid = next(q for q in descendants(self.p.pid) if q)

    def cmd(self, line: str) -> list[str]:
        """Send one command; return its output lines (up to 'done')."""
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        out = []
        while True:
            ln = self.p.stdout.readline()
            if not ln:
                raise EOFError(f"target exited ({self.p.wait()}) during {line!r}: {out}")
            ln = ln.strip()
            if ln == "done":
                return out
            out.append(ln)

    def victim(self, n: int, threads: int = 1) -> list[tuple[int, int, int, int, int]]:
        rows = []
        for ln in self.cmd(f"victim {n} {threads}"):
            m = LINE.match(ln)
            if m:
                rows.append(tuple(int(x) for x in m.groups()))
        return rows  # (thread idx, tid, i, ret, out)

    def alloc(self, n: int) -> list[tuple[int, int, int]]:
        return [
            (int(m.group(1)), int(m.group(2)), int(m.group(3), 16))
            for ln in self.cmd(f"alloc {n}")
            if (m := ALLOC.match(ln))
        ]

    def close(self) -> int:
        if self.p.poll() is None:
            try:
                assert self.p.stdin is not None
                self.p.stdin.write("quit\n")
                self.p.stdin.flush()
            except BrokenPipeError:
                pass
        return self.p.wait(timeout=10)


def bpf_progs() -> int:
    """gpufault engine programs loaded in the kernel now that are this test
    session's (conftest.our_bpf_progs): another gpufault running on this
    host at the same time (another session, an xdist worker beside this
    one) holds its own, not counted."""
    from conftest import our_bpf_progs

    return len(our_bpf_progs(lambda n: n.startswith(("gf_entry", "gf_return"))))


def no_new_progs(before: int, timeout: float = 10.0) -> bool:
    """The kernel frees a dead process's programs after an RCU grace
    period: await the count, do not sample it once."""
    deadline = time.monotonic() + timeout
    while bpf_progs() > before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # a kernel count, no event to wait on: poll it
    return True


def on_victim(cmd: str, pid: int) -> list[str]:
    """`CMD --pid PID --lib LIB --fn gf_victim`, the head of a gpufault
    command on the target's test function; each test adds its options."""
    return [cmd, "--pid", str(pid), "--lib", str(LIB), "--fn", "gf_victim"]
