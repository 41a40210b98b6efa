"""What this kernel allows, as the engine and the in-kernel call counter
(pyctl/calls/aggregate.py) ask it: the trial loads themselves live in
pyctl/bpf/features.py, `gpufault doctor`'s report in pyctl/api/doctor.py.

Light on purpose (the `trace` entry's early load imports it): nothing is
tried until a function is called, and each trial is kept for the boot.
"""

from __future__ import annotations

from pyctl.bpf.features import (
    MAIN_OBJ,
    REGS_PROBE_OBJ,
    UPROBE_PROGRAMS,
    engine_programs,
    regs_writable,
    select_programs,
    uprobe_multi,
    user_writable,
)

__all__ = [
    "MAIN_OBJ",
    "REGS_PROBE_OBJ",
    "UPROBE_PROGRAMS",
    "engine_programs",
    "regs_writable",
    "select_programs",
    "uprobe_multi",
    "user_writable",
]
