"""The library's one exception hierarchy.

Every error the API raises is a GpufaultError whose text is the CLI's one
line (`gpufault: <text>`), so a harness can print str(e) and a user reads
what to do. The engine's modules keep their own classes (SpecError,
EngineError, ResolveError, ...); `translate()` maps them onto this
hierarchy at the API's edge and keeps the original as __cause__.
"""

from __future__ import annotations

import errno


class GpufaultError(Exception):
    """Anything gpufault could not do; str() is the one-line message."""


class BadInput(GpufaultError, ValueError):
    """A spec, a target or an option that cannot work as given."""


class MissingPrerequisite(GpufaultError):
    """Root, a kernel feature, a tool or a library this host lacks."""


class TargetGone(GpufaultError):
    """The target process (or thread) does not exist or exited."""


class EvidenceWriteError(GpufaultError):
    """The run started but its evidence could not be written (disk full):
    every fault was disarmed and detached; what was written is kept."""


class ExperimentFailed(GpufaultError):
    """An experiment could not be run to a verdict (error or aborted)."""


_GONE_WORDS = ("no process", "no thread", "exited", "is a zombie", "still running?")


def translate(exc: BaseException) -> GpufaultError:
    """The hierarchy's class for one of the library's own exceptions."""
    if isinstance(exc, GpufaultError):
        return exc
    from pyctl.errors import hint_for

    text = str(exc) or type(exc).__name__
    hint = hint_for(exc)
    if hint and hint not in text:
        text = f"{text}: {hint}"
    from pyctl.engine import StoreWriteError

    if isinstance(exc, StoreWriteError):
        return EvidenceWriteError(text)
    if isinstance(exc, PermissionError) or (
        isinstance(exc, OSError) and exc.errno in (errno.EPERM, errno.EACCES)
    ):
        return MissingPrerequisite(text)
    from pyctl.bpf.libbpf import BpfError

    if isinstance(exc, BpfError):
        return MissingPrerequisite(text)
    if any(w in text for w in _GONE_WORDS):
        return TargetGone(text)
    return BadInput(text)


def user_error_types() -> tuple[type[BaseException], ...]:
    """The library's exceptions that are the caller's or the host's to fix
    (pyctl/errors.py lists them for the CLI too)."""
    from pyctl.errors import user_error_types as types

    return types()


__all__ = [
    "GpufaultError",
    "BadInput",
    "MissingPrerequisite",
    "TargetGone",
    "EvidenceWriteError",
    "ExperimentFailed",
    "translate",
]
