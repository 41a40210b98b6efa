"""`gpufault trace --pid` attaching before the CLI is imported (issue 26).

A plain trace's start-up is the time to probes live, and most of the
in-process start was Python importing click and the CLI (~25-50 ms on the
2-vCPU dev VM) and the database's open and the run's rows (~8 ms), none
of which the probe needs. So the entry (pyctl/entry.py) reads a plain
`trace --pid` line by hand (pyctl/argv.py plain_trace), builds the spec
and the run's settings as the CLI would, and starts the engine with
store_later: resolve, load (the early object), arm, attach. Then the CLI
is imported and parses the line as always, and the runner takes this
engine (runner.take_early) when what the CLI built is the same run: the
same specs, settings, pid and tid. Its second start() opens the database
and writes the run's rows; the calls made meanwhile waited in the ring
and are stored by the first drain (nothing lost: their call_seq counts
from 1, tests/test_early_attach.py).

Anything the early start cannot do or refuses (a bad pid, an unknown
symbol, not root) leaves nothing open and says nothing: the CLI's own
start then fails in its words. A line the CLI reads otherwise (a bad
value click refuses, another default) closes the early probes before
they were ever the run's: no row, no file. GPUFAULT_NO_EARLY_ATTACH=1
turns it off.
"""

from __future__ import annotations

import os
import sys

from pyctl.argv import PlainTrace
from pyctl.bpf import warmup
from pyctl.capabilities import MAIN_OBJ
from pyctl.engine import Engine
from pyctl.paths import DEFAULT_DB
from pyctl.run_options import DEFAULT_MAX_DB_BYTES, RunOptions
from pyctl.runner import (
    check_pid_namespace,
    check_target_pid,
    hold_stop_signals,
    offer_early,
    release_stop_signals,
)
from pyctl.spec import FaultSpec, parse_duration


def trace_run(p: PlainTrace) -> tuple[FaultSpec, RunOptions]:
    """The spec and settings `gpufault trace` builds from the same line
    (pyctl/cli/trace.py, pyctl/cli/launch.py run_settings, the defaults of
    pyctl/cli/options.py); raises SpecError on a bad value."""
    spec = FaultSpec.from_fields(
        {
            "lib": p.lib,
            "fn": tuple(p.fn),
            "no_stack": p.no_stack,
            "entry_only": p.entry_only,
            "action": "observe",
            "trace": True,
        }
    )
    db = p.db or p.root_db or os.environ.get("GPUFAULT_DB") or str(DEFAULT_DB)
    duration = parse_duration(p.duration, "--duration") if p.duration is not None else 0.0
    options = RunOptions(
        db_path=db,
        kind="trace",
        argv=("gpufault", *sys.argv[1:]),
        duration=duration,
        quiet=p.quiet,
        max_db_bytes=DEFAULT_MAX_DB_BYTES,
    )
    return spec, options


def attach(p: PlainTrace) -> bool:
    """Attach the probes of the plain trace p now; True when they are in
    (the runner takes them), False when the CLI's own start is left to
    do everything (and to say what is wrong)."""
    if os.environ.get("GPUFAULT_NO_EARLY_ATTACH") or os.environ.get("GPUFAULT_METRICS_ADDR"):
        return False
    if os.geteuid() != 0:  # the CLI's start says "needs root" in its words
        return False
    try:
        # The kernel's uprobe registration, warm by the attach below
        # (pyctl/bpf/warmup.py): its grace period passes meanwhile.
        warmup.start(str(MAIN_OBJ))
        spec, options = trace_run(p)
        check_pid_namespace()
        check_target_pid(p.pid)
        eng = Engine([spec], options=options, pid=p.pid, tid=None)
        if not eng.stores_later_ok():
            return False
        # Before the probes go in: once they are, a Ctrl-C must still let
        # the run store what they saw (runner.run ends it at once).
        hold_stop_signals()
        eng.start(store_later=True)
    except Exception:  # noqa: BLE001 - the CLI's start says it, in its words
        if release_stop_signals():  # a Ctrl-C meanwhile: no run to end, so as before
            raise KeyboardInterrupt from None
        return False
    offer_early([spec], options, p.pid, None, eng)
    return True
