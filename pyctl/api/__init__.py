"""gpufault's library API: everything the command line does, from Python.

    import gpufault
    from gpufault import Fault

    spec = Fault.fail("libcuda", "cuMemAlloc_v2", ret="CUDA_ERROR_OUT_OF_MEMORY", nth=3)
    with gpufault.arm(spec, 1234, db="/var/lib/gpufault/qa.db", duration=30) as h:
        h.wait_fires(1, timeout=10)
        for f in h.faults():
            print(f.show())

Stable names (docs/api.md): Fault, Target, arm, Session, IsolatedSession,
Counters, Fire, trace,
Evidence, FaultRecord, open_evidence, FaultSpec, and the errors
GpufaultError > BadInput, MissingPrerequisite, TargetGone,
EvidenceWriteError, ExperimentFailed; for tests, assert_fired and
assert_followed (pyctl/api/asserts.py). The `gpufault` package re-exports
this module and the experiment layer's run_experiment, load_experiment and
ExperimentVerdict (pyctl/experiment/public.py); the CLI, the experiment
runner's fault steps, the pytest plugin and the Chaos Toolkit extension are
its clients.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pyctl import __version__

# Loaded on first use (PEP 562): the CLI's start path imports
# pyctl.api.foreground alone, and `trace` start-up pays for nothing else.
_WHERE = {
    "assert_fired": "asserts", "assert_followed": "asserts",
    "BadInput": "errors", "EvidenceWriteError": "errors", "ExperimentFailed": "errors",
    "GpufaultError": "errors", "MissingPrerequisite": "errors", "TargetGone": "errors",
    "Evidence": "evidence", "FaultRecord": "evidence", "open_evidence": "evidence",
    "Fault": "faults",
    "trace": "runs",
    "Counters": "session", "Fire": "session", "IsolatedSession": "session",
    "Session": "session", "arm": "session",
    "Target": "target",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name == "FaultSpec":
        from pyctl.spec import FaultSpec

        return FaultSpec
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'pyctl.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pyctl.api.{mod}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from pyctl.api.asserts import assert_fired, assert_followed
    from pyctl.api.errors import (
        BadInput,
        EvidenceWriteError,
        ExperimentFailed,
        GpufaultError,
        MissingPrerequisite,
        TargetGone,
    )
    from pyctl.api.evidence import Evidence, FaultRecord, open_evidence
    from pyctl.api.faults import Fault
    from pyctl.api.runs import trace
    from pyctl.api.session import Counters, Fire, IsolatedSession, Session, arm
    from pyctl.api.target import Target
    from pyctl.spec import FaultSpec

__all__ = [
    "__version__",
    "Fault",
    "FaultSpec",
    "Target",
    "arm",
    "Session",
    "IsolatedSession",
    "Counters",
    "Fire",
    "trace",
    "Evidence",
    "FaultRecord",
    "open_evidence",
    "GpufaultError",
    "BadInput",
    "MissingPrerequisite",
    "TargetGone",
    "EvidenceWriteError",
    "ExperimentFailed",
    "assert_fired",
    "assert_followed",
]
