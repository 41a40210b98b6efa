"""A run's settings, in one object from the CLI to the Runner to the Engine.

What a run is told besides its faults and its target: where the evidence
goes, how long it lasts, how loud it is, which signal the copilot uses.
The CLI builds one RunOptions from its option bundles
(pyctl/cli/options.py); `runner.run`, `Runner` and `Engine` take it whole
instead of a dozen parameters passed down by hand. The target (pid, tid,
command) is not a setting: it is runner.Target, and it is never written
into the specs (the engine gives it to each spec's BPF copy when it arms).

Light on purpose (no BPF, no engine import): the CLI builds it before it
knows whether the run will start.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from pyctl.paths import DEFAULT_DB

DEFAULT_MAX_DB_BYTES = 1 << 30  # --max-db-size: call rows stop here (faults do not)


@dataclass(frozen=True)
class RunOptions:
    db_path: str | os.PathLike[str] = DEFAULT_DB
    kind: str = "inject"  # the run row's kind: trace, inject, template:NAME@vN, demo
    argv: Sequence[str] = ()  # the command line, recorded in the run row
    duration: float = 0.0  # seconds; 0: until Ctrl-C or the target's end
    copilot_signal: int | None = None  # None: the engine's default (SIGURG)
    # --mechanism: how fails and stalls are carried out where BPF cannot
    # write registers: auto (the signal helper by trial, else the copilot),
    # signal (the helper or refuse), copilot; None: auto (GPUFAULT_SIGNAL=0: copilot).
    mechanism: str | None = None
    quiet: bool = False  # no per-fire lines, no status line
    xids: bool = True  # record NVIDIA Xids beside the run where the tracepoint exists
    max_db_bytes: int = DEFAULT_MAX_DB_BYTES  # 0: no cap
    metrics_addr: str | None = None  # serve gpufault's Prometheus metrics here (pyctl/observe)
    # --ready-fd: "ready RUN\n" is written here once every probe is live,
    # then it is closed (what a script waits for, -q or not).
    ready_fd: int | None = None
    # --stack-copy: bytes of user stack copied at each fire for the CFI
    # unwinder; None: the default (bpf/main_object.py USTACK_BYTES), 0: off.
    stack_copy_bytes: int | None = None
    # Who the target is besides its pid (a selector's labels: rank, the
    # selector, the container's name), written into the run's targets row.
    target_labels: tuple[tuple[str, object], ...] = ()

    @property
    def status(self) -> bool:
        """Show the one-line status (only ever on a terminal, Runner decides)."""
        return not self.quiet
