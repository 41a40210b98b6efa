"""SIGCHLD blocked in every controller thread, for the ptrace copilot.

Its own module, not the copilot's: the controller blocks SIGCHLD before its
first thread starts, on every run, and importing the copilot for that (its
tracer, ptrace and watchdog modules, logging) cost ~20 ms of every
`gpufault trace` start though a trace never uses it.
"""

from __future__ import annotations

import signal

SIGCHLD_SET = {signal.SIGCHLD}
_ORIGINAL_MASK: set[int] | None = None


def block_sigchld() -> None:
    """Block SIGCHLD in the calling thread and the threads it creates later.

    Call it in the controller's main thread before starting other threads:
    then no thread but the copilot's can take a tracee's SIGCHLD, and every
    stop wakes the tracer at once. Children inherit a thread's mask through
    fork and exec, so a command gpufault starts must be started with
    original_sigmask() (runner.py does), or its own SIGCHLD handler never runs.
    """
    global _ORIGINAL_MASK
    old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGCHLD_SET)
    if _ORIGINAL_MASK is None:
        _ORIGINAL_MASK = set(old)


def original_sigmask() -> set[int]:
    """The calling thread's signal mask before block_sigchld() changed it."""
    if _ORIGINAL_MASK is not None:
        return set(_ORIGINAL_MASK)
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, set()))
