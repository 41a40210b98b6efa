"""The in-process faults from Python: VRAM pressure, Tensor Core bit flips
and the LD_PRELOAD shim, each stored as a run with its faults, as
`gpufault hooks` does.

The hooks run as child processes in isolated mode (pyctl.paths.module_argv:
never from the working directory, nor PYTHONPATH), so importing this needs
no torch. Nothing here installs a signal handler unless asked
(forward_signals=True in vram_pressure).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pyctl import paths
from pyctl.exceptions import BadInput, MissingPrerequisite

PRELOAD_SHIM = paths.PRELOAD_SHIM  # the shim `make build` puts in pyctl/data/preload/


def hook_module(name: str, args: Sequence[str]) -> int:
    """Run pyctl.hooks.<name> with args in an isolated child; its status."""
    # A child process: vram_pressure must own its signals and its CUDA context.
    return subprocess.call(paths.module_argv(f"pyctl.hooks.{name}", list(args)))


def vram_pressure(
    db: str | Path,
    *,
    share: float,
    duration: float,
    device: int = 0,
    allocator: str = "auto",
    argv: Sequence[str] = (),
    on_line: Callable[[str], None] | None = None,
    forward_signals: bool = False,
) -> tuple[int, str]:
    """Hold `share` (0..1) of free VRAM on `device` for `duration` seconds
    in a child process, checked with NVML; its JSON lines go to on_line as
    they come, and the hold is stored as a fault once it holds. With
    forward_signals (the main thread only), SIGTERM and SIGINT go to the
    child, which releases and says so. Returns (the child's status, the
    run id or '' when it never held)."""
    # lazy: keeps pyctl.hooks.record (+29 modules, ~100 ms) off `--help` and `import gpufault`
    from pyctl.hooks.record import VramRun

    spec = {"share": share, "duration": duration, "device": device, "allocator": allocator}
    args = [
        "--share",
        str(share),
        "--duration",
        str(duration),
        "--device",
        str(device),
        "--allocator",
        allocator,
    ]
    rec = VramRun(db, list(argv), spec)
    child = subprocess.Popen(
        paths.module_argv("pyctl.hooks.vram_pressure", args), stdout=subprocess.PIPE, text=True
    )
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    if forward_signals:

        def forward(signo: int, _frame: object) -> None:
            if child.poll() is None:
                child.send_signal(signo)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
    code = 1
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if on_line is not None:
                on_line(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            rec.event(event)
        code = child.wait()
    finally:
        if child.poll() is None:  # we failed, not the child: it must not hold on
            child.terminate()
            code = child.wait()
        if forward_signals:
            signal.signal(signal.SIGTERM, old[0])
            signal.signal(signal.SIGINT, old[1])
        run_id = rec.end(code)
    return code, run_id or ""


def tc_measure(
    db: str | Path,
    args: Sequence[str],
    spec: Mapping[str, Any],
    *,
    argv: Sequence[str] = (),
) -> tuple[int, str, int]:
    """Run pyctl/hooks/tc_measure.py (divergence per flipped bit on a tiny
    random transformer) with its own options `args`; when it succeeds, its
    per-layer flip counts are stored as one fault per bit spec and layer.
    Returns (its status, the run id or '', the faults stored)."""
    # Per-layer flip counts come back in a private file; stored once it ran.
    with tempfile.TemporaryDirectory(prefix="tc-measure-") as tmp:
        events = Path(tmp) / "events.jsonl"
        code = hook_module("tc_measure", [*args, "--gf-events", str(events)])
        if code != 0 or not events.exists():
            return code, "", 0
        # lazy: keeps pyctl.hooks.record (+29 modules, ~100 ms) off `--help` and `import gpufault`
        from pyctl.hooks.record import record_tc

        rows = [json.loads(x) for x in events.read_text().splitlines() if x]
        run_id, n = record_tc(db, list(argv), dict(spec), rows)
    return code, run_id, n


def check_preload_rules(rules: str, so: str | os.PathLike[str] = PRELOAD_SHIM) -> None:
    """MissingPrerequisite without the shim, BadInput (the shim's own one
    line) for rules it refuses: the shim validates them itself, one parser
    and one error text."""
    if not Path(so).exists():
        raise MissingPrerequisite(f"{so} is missing: build it with make build")
    chk = subprocess.run(
        ["/bin/true"],
        env={"LD_PRELOAD": str(so), "GPUFAULT_PRELOAD": rules},
        capture_output=True,
        text=True,
    )
    if chk.returncode != 0:
        raise BadInput(chk.stderr.strip())


def preload_env(
    rules: str,
    log: str | os.PathLike[str] = "gfpreload.jsonl",
    so: str | os.PathLike[str] = PRELOAD_SHIM,
) -> dict[str, str]:
    """The environment that runs a program under the shim with `rules`,
    its faults logged as JSON lines to `log` (checked first)."""
    check_preload_rules(rules, so)
    return {
        "LD_PRELOAD": str(so),
        "GPUFAULT_PRELOAD": rules,
        "GPUFAULT_PRELOAD_LOG": str(Path(log).absolute()),
    }


def preload(
    db: str | Path,
    rules: str,
    command: Sequence[str],
    *,
    so: str | os.PathLike[str] = PRELOAD_SHIM,
    argv: Sequence[str] = (),
) -> tuple[int, str, int]:
    """Run `command` under the shim; each fire becomes a fault of one run,
    imported when it ends (also after a KeyboardInterrupt, which reached
    the program too). Returns (its status, the run id, the faults)."""
    # lazy: keeps pyctl.hooks.record (+29 modules, ~100 ms) off `--help` and `import gpufault`
    from pyctl.hooks.record import import_preload

    check_preload_rules(rules, so)
    with tempfile.TemporaryDirectory(prefix="preload-log-") as tmp:
        log = Path(tmp) / "fires.jsonl"
        env = {
            **os.environ,
            "LD_PRELOAD": str(so),
            "GPUFAULT_PRELOAD": rules,
            "GPUFAULT_PRELOAD_LOG": str(log),
        }
        started = time.time()
        try:
            child = subprocess.Popen(list(command), env=env)
        except OSError as e:
            raise BadInput(f"{command[0]}: {e.strerror}: pass a program that exists") from None
        try:
            code = child.wait()
        except KeyboardInterrupt:
            # The terminal's SIGINT reached the program too: wait for it,
            # then import what it logged.
            code = child.wait()
        run_id, n = import_preload(db, list(argv), log, rules, exit_code=code, started=started)
    return code, run_id, n


def preload_import(
    db: str | Path,
    log: str | os.PathLike[str],
    rules: str = "",
    *,
    argv: Sequence[str] = (),
) -> tuple[str, int]:
    """Import a shim log (GPUFAULT_PRELOAD_LOG of preload_env) as a run:
    (run id, faults)."""
    # lazy: keeps pyctl.hooks.record (+29 modules, ~100 ms) off `--help` and `import gpufault`
    from pyctl.hooks.record import import_preload

    return import_preload(db, list(argv), Path(log), rules)


__all__ = [
    "PRELOAD_SHIM",
    "check_preload_rules",
    "hook_module",
    "preload",
    "preload_env",
    "preload_import",
    "tc_measure",
    "vram_pressure",
]
