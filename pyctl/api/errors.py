"""The library's one exception hierarchy (defined at the bottom of the
house, pyctl/exceptions.py, so that every layer raises it), and how the
API's edge reads an exception that is not one of them.

Every error the API raises is a GpufaultError whose text is the CLI's one
line (`gpufault: <text>`): the modules' own classes (SpecError is a
BadInput, BpfError a MissingPrerequisite, StoreWriteError an
EvidenceWriteError, ...) already are; `translate()` names the rest and
keeps the original as __cause__.
"""

from __future__ import annotations

import errno

from pyctl import exceptions
from pyctl.exceptions import (
    BadInput,
    EvidenceWriteError,
    ExperimentFailed,
    GpufaultError,
    MissingPrerequisite,
    TargetGone,
)

_GONE_WORDS = ("no process", "no thread", "exited", "is a zombie", "still running?")
_SPECIFIC = (BadInput, MissingPrerequisite, TargetGone, EvidenceWriteError, ExperimentFailed)


def translate(exc: BaseException) -> GpufaultError:
    """The hierarchy's reading of an exception raised under the API."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, GpufaultError):
        # A generic class (EngineError, CopilotError) that says the target
        # is gone is the caller's TargetGone.
        if not isinstance(exc, _SPECIFIC) and any(w in text for w in _GONE_WORDS):
            return _with_cause(TargetGone(text), exc)
        return exc
    if isinstance(exc, PermissionError) or (
        isinstance(exc, OSError) and exc.errno in (errno.EPERM, errno.EACCES)
    ):
        return _with_cause(MissingPrerequisite(f"{text}: run as root"), exc)
    if isinstance(exc, (ValueError, TypeError)):
        return _with_cause(BadInput(text), exc)
    return _with_cause(
        GpufaultError(f"internal error ({type(exc).__name__}: {text}): please report it"), exc
    )


def _with_cause(new: GpufaultError, cause: BaseException) -> GpufaultError:
    new.__cause__ = cause
    return new


__all__ = [*exceptions.__all__, "translate"]
