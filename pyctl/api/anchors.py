"""The gpufa kernel module's anchors (docs/kmod.md) from Python: its
status, the records as they arrive (stored as evidence), a manual fire.
What `gpufault anchors` prints."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pyctl.exceptions import MissingPrerequisite

if TYPE_CHECKING:
    from pyctl.anchors.record import AnchorRecord

SYS = Path("/sys/module/gpufa")


@dataclass
class ModuleStatus:
    """Whether gpufa.ko is loaded, its parameters and its device's counters."""

    loaded: bool
    params: dict[str, str] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)


def status() -> ModuleStatus:
    """The module's state now (nothing is opened unless it is loaded)."""
    if not SYS.exists():
        return ModuleStatus(False)
    # lazy: the device module (ctypes, the uapi, ~40 ms) off `import gpufault`
    from pyctl.anchors.device import DEFAULT_PATH, AnchorDevice

    st = ModuleStatus(True)
    params = SYS / "parameters"
    if params.exists():
        for p in sorted(params.iterdir()):
            try:
                st.params[p.name] = p.read_text().strip()
            except OSError:
                continue
    if os.path.exists(DEFAULT_PATH):
        with AnchorDevice(nonblock=True) as dev:
            st.stats = dict(dev.stats())
    return st


def record_line(r: AnchorRecord) -> str:
    """One anchor record on a line: kind, fault ID, device, process, code, BAR0."""
    bar0 = " ".join(f"{off:#x}={'-' if v is None else hex(v)}" for off, v in sorted(r.bar0.items()))
    return (
        f"{r.kind:12} {r.fault_id:14} {r.bdf} {r.vendor:04x}:{r.device:04x} "
        f"pid {r.pid} ({r.comm}) code {r.code:#x} bar0 {bar0}"
    )


def watch(
    on_records: Callable[[list[AnchorRecord]], None],
    *,
    db: str | os.PathLike[str] | None = None,
    duration: float = 0.0,
) -> None:
    """Read records as they arrive, for `duration` seconds (0: until
    KeyboardInterrupt, which ends it quietly), calling on_records with each
    batch and storing them in the store at `db` when given.
    MissingPrerequisite when the device cannot be opened."""
    # lazy: the device module (ctypes, the uapi, ~40 ms) off `import gpufault`
    from pyctl.anchors.device import AnchorDevice

    # lazy: pyctl.evidence.store (datetime, sqlite3, +12 modules) only when this runs
    from pyctl.evidence import store

    # lazy: keeps pyctl.evidence.anchors (datetime, sqlite3, +11 modules) off `--help`
    from pyctl.evidence.anchors import store_records

    try:
        dev = AnchorDevice(nonblock=True)
    except OSError as e:
        raise MissingPrerequisite(str(e.strerror or e)) from None
    conn = store.open_db(db) if db else None
    t0 = time.monotonic()
    try:
        while not duration or time.monotonic() - t0 < duration:
            dev.wait(0.2)
            recs = dev.read()
            if recs:
                on_records(recs)
            if conn is not None and recs:
                store_records(conn, recs)
    except KeyboardInterrupt:
        pass
    finally:
        dev.close()


def fire(bdf: str | None = None, code: int = 0) -> None:
    """Fire a manual anchor (QA): snapshot a watched device (default: the
    first) now. MissingPrerequisite when the module refuses."""
    # lazy: the device module (ctypes, the uapi, ~40 ms) off `import gpufault`
    from pyctl.anchors.device import AnchorDevice

    try:
        with AnchorDevice() as dev:
            dev.fire(bdf, code)
    except OSError as e:
        raise MissingPrerequisite(f"fire failed: {e.strerror or e}") from None


__all__ = ["ModuleStatus", "fire", "record_line", "status", "watch"]
