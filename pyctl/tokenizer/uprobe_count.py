"""Count calls of entry points with plain tracefs uprobes (no BPF).

This is the probe-only observer for `--target pid:N` and the check that the
symbol finder's offsets are right: the kernel counts every hit of each
uprobe in `uprobe_profile`. The BPF engine (pyctl/bpf) is the full path
(arguments, latency, faults); this needs only tracefs.

Probes live in our own event group `gftok_<pid>` and are enabled in our own
trace instance, so the global trace buffer and other users' probes are left
alone. Counts are per file, not per process: every process that maps the
library and calls the function is counted.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from pyctl.symbols.tokenizers import EntryPoint

TRACEFS = Path("/sys/kernel/tracing")


def tracefs_ready() -> str | None:
    """None if uprobe events can be created here, else why not. Mounts
    tracefs (saying so in one line) when nothing is mounted."""
    # lazy: pyctl.tracefs (ctypes, +5 modules) only when this runs
    from pyctl import tracefs

    if os.geteuid() != 0:
        return "requires root (tracefs uprobe_events)"
    try:
        where = Path(tracefs.ensure("the tokenizer uprobe counter"))
    except tracefs.TracefsError as e:
        return str(e)
    if not (where / "uprobe_events").exists():
        return "kernel lacks CONFIG_UPROBE_EVENTS (no uprobe_events in tracefs)"
    return None


def _write(path: Path, line: str) -> None:
    # One write(2) per command: the kernel parses each write on its own.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class UprobeCounter:
    """Context manager: attach one uprobe per entry point, read hit counts.

    >>> with UprobeCounter(points) as c:
    ...     workload()
    ...     hits = c.counts()
    """

    def __init__(self, points: Sequence[EntryPoint], *, offset: int = 0) -> None:
        if not points:
            raise ValueError("no entry points to probe")
        self.points = list(points)
        self.offset = offset  # e.g. 4 to skip an endbr64
        self.group = f"gftok_{os.getpid()}_{secrets.token_hex(2)}"
        self.tf = TRACEFS  # where tracefs is, found again at __enter__
        self.events: list[str] = []

    @property
    def _instance(self) -> Path:
        return self.tf / "instances" / self.group

    def __enter__(self) -> UprobeCounter:
        # lazy: pyctl.tracefs (ctypes, +5 modules) only when this runs
        from pyctl import tracefs

        why = tracefs_ready()
        if why:
            raise PermissionError(why)
        self.tf = Path(tracefs.find() or TRACEFS)
        try:
            for i, ep in enumerate(self.points):
                # uprobe_profile prints the event name without its group,
                # so the name itself must be unique.
                name = f"{self.group}_{i}"
                _write(
                    self.tf / "uprobe_events",
                    f"p:{self.group}/{name} {ep.library}:{ep.file_offset + self.offset:#x}",
                )
                self.events.append(name)
            self._instance.mkdir()
            # A small buffer: we only need the kernel to take the hits.
            (self._instance / "buffer_size_kb").write_text("64")
            (self._instance / "events" / self.group / "enable").write_text("1")
        except BaseException:
            self._teardown()
            raise
        return self

    def counts(self) -> dict[int, int]:
        """Hits so far per index into `points`."""
        hits: dict[int, int] = {}
        names = {name: i for i, name in enumerate(self.events)}
        for line in (self.tf / "uprobe_profile").read_text().splitlines():
            # "<file> <event> <nhit>" (some kernels add a missed count)
            fields = line.split()
            if len(fields) >= 3 and fields[1] in names:
                hits[names[fields[1]]] = int(fields[2])
        return {i: hits.get(i, 0) for i in range(len(self.points))}

    def _teardown(self) -> None:
        ev = self._instance / "events" / self.group / "enable"
        if ev.exists():
            try:
                ev.write_text("0")
            except OSError:
                pass
        if self._instance.exists():
            try:
                self._instance.rmdir()
            except OSError:
                pass
        for name in self.events:
            try:
                _write(self.tf / "uprobe_events", f"-:{self.group}/{name}")
            except OSError:
                pass
        self.events.clear()

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._teardown()
