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
import sys

from pyctl import exceptions
from pyctl.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_RUN_FAILED, EXIT_USER, one_line
from pyctl.errors import user_error_types as user_error_types
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
    if (damaged := damaged_store_line(exc)) is not None:
        return _with_cause(BadInput(damaged), exc)  # the file's fault, not a bug
    return _with_cause(
        GpufaultError(f"internal error ({type(exc).__name__}: {text}): please report it"), exc
    )


def cli_line(exc: BaseException) -> tuple[int, str] | None:
    """How the command line reports exc: (exit status, its one line), or
    None when it is not the user's or the host's to fix (a bug: the CLI's
    internal-error path). A run whose evidence could not be written is
    exit 3; bad input, the engine's refusals and ValueErrors say their
    text as it is; the rest of the hierarchy (a kernel without a feature,
    no catalog) gets its hint ("see `gpufault doctor`")."""
    if isinstance(exc, EvidenceWriteError):
        return EXIT_RUN_FAILED, str(exc)
    if (damaged := damaged_store_line(exc)) is not None:
        return EXIT_USER, damaged
    # lazy: keeps pyctl.engine.errors (+73 modules, ~300 ms) off `import gpufault`
    from pyctl.engine.errors import EngineError

    if isinstance(exc, (BadInput, EngineError, ValueError)):
        return EXIT_USER, str(exc)
    if isinstance(exc, GpufaultError):
        return EXIT_USER, one_line(exc)
    return None


def damaged_store_line(exc: BaseException) -> str | None:
    """A damaged store page's one line (pyctl.evidence.store.damaged_line),
    without importing the store for an error that cannot be one."""
    sqlite3 = sys.modules.get("sqlite3")
    if sqlite3 is None or not isinstance(exc, sqlite3.DatabaseError):
        return None
    # lazy: keeps pyctl.evidence.store (+26 modules, ~100 ms) off `import gpufault`
    from pyctl.evidence.store import damaged_line

    return damaged_line(exc)


def _with_cause(new: GpufaultError, cause: BaseException) -> GpufaultError:
    new.__cause__ = cause
    return new


__all__ = [
    *exceptions.__all__,
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_RUN_FAILED",
    "EXIT_USER",
    "cli_line",
    "damaged_store_line",
    "one_line",
    "translate",
    "user_error_types",
]
