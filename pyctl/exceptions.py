"""gpufault's one exception hierarchy, at the bottom of the house.

Every error the library raises for the caller or the host to fix is one of
these; its text is the CLI's one line (`gpufault: <text>`), so a harness
can print str(e) and the user reads what to do. The modules' own classes
(SpecError, EngineError, ResolveError, BpfError, ...) subclass them, so
`except gpufault.BadInput` catches a bad spec wherever it was found. No
imports: every layer may raise them.
"""

from __future__ import annotations


class GpufaultError(Exception):
    """Anything gpufault could not do; str() is the one-line message."""


class BadInput(GpufaultError, ValueError):
    """A spec, a target, a file or an option that cannot work as given."""


class MissingPrerequisite(GpufaultError):
    """Root, a kernel feature, a tool or a library this host lacks."""


class TargetGone(GpufaultError):
    """The target process (or thread) does not exist or exited."""


class EvidenceWriteError(GpufaultError):
    """The run started but its evidence could not be written (disk full):
    every fault was disarmed and detached; what was written is kept."""


class ExperimentFailed(GpufaultError):
    """An experiment could not be run to a verdict (error or aborted)."""


__all__ = [
    "GpufaultError",
    "BadInput",
    "MissingPrerequisite",
    "TargetGone",
    "EvidenceWriteError",
    "ExperimentFailed",
]
