"""What a trace imports before its probes are live (docs/benchmarks.md,
"Attach time"): each module kept off this path saved 10-110 ms of every
`gpufault trace --pid` start. A new import of one of them fails here."""

from __future__ import annotations

import subprocess
import sys

# Each was on the path once: sqlite-utils (and its dateutil, pluggy, and
# numpy where installed) for the store; the copilot for SIGCHLD's mask;
# secrets and socket for a run id and a host name.
KEPT_OFF = ("sqlite_utils", "dateutil", "pluggy", "numpy", "pyctl.copilot", "secrets", "socket")


def test_the_trace_path_imports_none_of_the_slow_modules() -> None:
    code = (
        "import sys\n"
        "import pyctl.cli, pyctl.cli.trace, pyctl.cli.launch, pyctl.engine, pyctl.runner\n"
        "from pyctl.sigmask import block_sigchld\n"
        "block_sigchld()\n"
        f"print(sorted(m for m in {KEPT_OFF!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out
