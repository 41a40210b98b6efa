"""The engine's two exceptions, apart so that every engine module can raise
them without importing the event loop (pyctl/engine/__init__.py)."""

from __future__ import annotations

from pyctl.exceptions import EvidenceWriteError, GpufaultError


class EngineError(GpufaultError):
    """One-line, user-facing error; nothing is left attached."""


class StoreWriteError(EngineError, EvidenceWriteError):
    """Writing the evidence failed mid-run (disk full, I/O error): every
    fault was disarmed at once; the run is to be closed as failed."""
