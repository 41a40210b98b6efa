"""Find kernel splats (warnings, BUGs, oopses, sanitizer reports) in a
kernel log, in the spirit of libbpf CI's check-kernel-splats."""

from __future__ import annotations

import re

# Each pattern starts a splat report; "Call Trace:" also catches stack dumps
# that other reports (hung tasks, unchecked MSR accesses, lockdep) print.
SPLAT = re.compile(
    r"(WARNING:|BUG:|Oops|KASAN:|UBSAN:|kernel BUG at|general protection fault"
    r"|Kernel panic|Call Trace:|watchdog: BUG|INFO: task .* blocked)"
)
# dmesg prefixes each line with "[   12.345678] ".
_STAMP = re.compile(r"^\[\s*\d+\.\d+\]\s?")


def find_splats(log: str) -> list[str]:
    """The log lines that start a splat, time stamps removed."""
    out = []
    for line in log.splitlines():
        text = _STAMP.sub("", line.strip())
        if SPLAT.search(text):
            out.append(text)
    return out


def report_excerpt(log: str, lines: int = 16) -> str:
    """The first splat report, up to `lines` lines from where it starts:
    enough (RIP, Code, the call trace's top) to tell a guest-kernel crash
    from a bug of ours when a run dies without an exit status."""
    kept: list[str] = []
    for line in log.splitlines():
        text = _STAMP.sub("", line.strip())
        if kept or SPLAT.search(text):
            kept.append(text)
            if len(kept) >= lines:
                break
    return "\n".join(kept)
