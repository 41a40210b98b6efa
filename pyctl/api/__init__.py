"""gpufault's library API: everything the command line does, from Python.

    import gpufault
    from gpufault import Fault

    spec = Fault.fail("libcuda", "cuMemAlloc_v2", ret="CUDA_ERROR_OUT_OF_MEMORY", nth=3)
    with gpufault.arm(spec, 1234, db="/tmp/gf.db", duration=30) as h:
        h.wait_fires(1, timeout=10)
        for f in h.faults():
            print(f.show())

Stable names (docs/api.md): Fault, Target, arm, Session, IsolatedSession,
Counters, Fire, trace, run_experiment, load_experiment, ExperimentVerdict,
Evidence, FaultRecord, open_evidence, FaultSpec, and the errors
GpufaultError > BadInput, MissingPrerequisite, TargetGone,
EvidenceWriteError, ExperimentFailed; for tests, assert_fired and
assert_followed (pyctl/api/asserts.py). The `gpufault` package re-exports
this module; the CLI, the experiment runner's fault steps, the pytest
plugin and the Chaos Toolkit extension are its clients.
"""

from __future__ import annotations

from pyctl import __version__
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
from pyctl.api.runs import ExperimentVerdict, load_experiment, run_experiment, trace
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
    "run_experiment",
    "load_experiment",
    "ExperimentVerdict",
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
