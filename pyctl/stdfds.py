"""Descriptors 0, 1 and 2 made sure of, first thing in the entry
(pyctl/entry.py). Its own module, importing nothing the interpreter has
not loaded already (`_signal`, not `signal`, whose enum classes cost ~4
ms; no `typing`, ~4 ms): the entry runs it before the served path's
client, which is kept as light (pyctl/resident/client.py).
(It was pyctl/outchan.py's, the best-effort stderr of a run.)"""

from __future__ import annotations

import _signal
import os
import stat
import sys


def _is_null_device(fd: int) -> bool:
    st = os.fstat(fd)
    return stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 1 and os.minor(st.st_rdev) == 3


def fill_std_fds() -> None:
    """Descriptors 0, 1 and 2 open before anything else is: started with one
    closed (`2>&-`), the next file gpufault opened (the database, a BPF map)
    took its number, so a line for stderr, or the `-- CMD` target's own
    stderr, would have written into it. A closed one gets /dev/null
    (checked to be the null device on the descriptor), and sys.std* that
    Python left None for it become streams on it. SIGPIPE is ignored
    (Python's default, made sure of): a dead reader is EPIPE, not death."""
    try:
        _signal.signal(_signal.SIGPIPE, _signal.SIG_IGN)
    except (ValueError, OSError):
        pass  # not the main thread: Python set it at start-up
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        nul = os.open("/dev/null", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        if not _is_null_device(nul):
            sys.exit("gpufault: /dev/null is not the null device: fix the system's /dev")
        if nul != fd:
            os.dup2(nul, fd)
            os.close(nul)
        os.set_inheritable(fd, True)  # as it would have been: `-- CMD` inherits it
    if sys.stdin is None:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - lives as long as the process
    for name, fd in (("stdout", 1), ("stderr", 2)):
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "w", closefd=False, errors="backslashreplace"))  # noqa: SIM115
