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
assert_followed (pyctl/api/asserts.py); and the rest of the command line as
data: DoctorReport, probe_sites, fault_list, show, timeline, run_summary,
calls_live, release, and the modules anchors, doctor, hooks, netchaos,
tokenizer, templates. The `gpufault` package re-exports
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
    # The CLI's other commands, as data and text (docs/api.md "Everything else").
    "DoctorReport": "doctor",
    "probe_sites": "probes", "catalog_functions": "probes",
    "fault_list": "reading", "show": "reading", "timeline": "reading",
    "run_summary": "calls", "calls_live": "calls:live",
    "release": "control",
}  # fmt: skip
# Whole modules, for the groups of commands: gpufault.netchaos.loss(...), ...
# (gpufault.doctor is the module: gpufault.doctor.report(["xids"]).)
_MODULES = ("anchors", "doctor", "hooks", "netchaos", "tokenizer", "templates")


def __getattr__(name: str) -> Any:
    if name == "FaultSpec":
        # lazy: pyctl.spec (ast, copy, +19 modules, ~100 ms) only when this runs
        from pyctl.spec import FaultSpec

        return FaultSpec
    if name in _MODULES:
        return importlib.import_module(f"pyctl.api.{name}")
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'pyctl.api' has no attribute {name!r}")
    mod, _, attr = where.partition(":")
    value = getattr(importlib.import_module(f"pyctl.api.{mod}"), attr or name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from pyctl.api import anchors, doctor, hooks, netchaos, templates, tokenizer
    from pyctl.api.asserts import assert_fired, assert_followed
    from pyctl.api.calls import live as calls_live
    from pyctl.api.calls import run_summary
    from pyctl.api.control import release
    from pyctl.api.doctor import DoctorReport
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
    from pyctl.api.probes import catalog_functions, probe_sites
    from pyctl.api.reading import fault_list, show, timeline
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
    "doctor",
    "DoctorReport",
    "probe_sites",
    "catalog_functions",
    "fault_list",
    "show",
    "timeline",
    "run_summary",
    "calls_live",
    "release",
    "anchors",
    "hooks",
    "netchaos",
    "tokenizer",
    "templates",
]
