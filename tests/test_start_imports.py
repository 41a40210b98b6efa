"""What a trace imports before its probes are live (docs/benchmarks.md,
"Attach time"): each module kept off this path saved 10-110 ms of every
`gpufault trace --pid` start. A new import of one of them fails here."""

from __future__ import annotations

import subprocess
import sys

# Each was on the path once: sqlite-utils (and its dateutil, pluggy, and
# numpy where installed) for the store; the copilot for SIGCHLD's mask;
# secrets and socket for a run id and a host name; ctypes.util (with
# subprocess and tempfile) for finding libbpf and libstdc++ by short name,
# subprocess for `-- CMD` and tempfile for cache writes (~20 ms together);
# the stack machinery (the map watch, the unwinder and its CFI decoder, the
# Python-frame reader), which a trace never fires (~7-10 ms).
KEPT_OFF = (
    "pyctl.symbols.mapwatch",
    "pyctl.symbols.unwind",
    "pyctl.symbols.cfi",
    "pyctl.symbols.pystack",
    "sqlite_utils",
    "dateutil",
    "pluggy",
    "numpy",
    "pyctl.copilot",
    "secrets",
    "socket",
    "ctypes.util",
    "subprocess",
    "tempfile",
)


def test_the_trace_path_imports_none_of_the_slow_modules() -> None:
    code = (
        "import sys\n"
        # What the interpreter's site already imported is not ours (this
        # machine's .pth hooks import tempfile, say).
        "pre = set(sys.modules)\n"
        "import pyctl.entry, pyctl.bpf.main_object\n"
        "import pyctl.cli, pyctl.cli.trace, pyctl.cli.launch, pyctl.engine, pyctl.runner\n"
        "from pyctl.sigmask import block_sigchld\n"
        "block_sigchld()\n"
        "import pyctl.bpf.libbpf, pyctl.symbols.demangle, pyctl.diskcache\n"
        "pyctl.bpf.libbpf.lib(); pyctl.symbols.demangle._cxa(); pyctl.diskcache.load_caps()\n"
        f"print(sorted(m for m in {KEPT_OFF!r} if m in sys.modules and m not in pre))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out


# What a plain `trace --pid` imports before its probes are in (pyctl/early.py
# attaches them before the CLI, the store and the run's rows): the store and
# what it alone needs come after (~8-12 ms of imports on the dev VM).
STORE_AFTER_ATTACH = (
    "click",
    "sqlite3",
    "json",
    "hashlib",
    "pyctl.evidence",
    "pyctl.evidence.store",
    "pyctl.evidence.schema",
    "pyctl.cli",
)


def test_the_early_attach_imports_no_store_before_the_probes() -> None:
    code = (
        "import sys\n"
        "pre = set(sys.modules)\n"
        "import pyctl.entry, pyctl.stdfds, pyctl.resident.client, pyctl.bpf.main_object\n"
        "import pyctl.early\n"
        f"print(sorted(m for m in {STORE_AFTER_ATTACH!r} if m in sys.modules and m not in pre))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out
