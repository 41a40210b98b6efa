"""The method's step kinds, one module each, each registering itself:
fault (a template or an inline fault, armed by the FaultHost), traffic (a
second load of adversarial requests), perturb (bit flips the service arms
in its own model), pressure (a second process holding VRAM). See base.py
for what a kind provides; the runner looks a step's kind up in KINDS."""

from __future__ import annotations

from pyctl.experiment.steps import fault, perturb, pressure, traffic  # noqa: F401 - they register
from pyctl.experiment.steps.base import (
    KINDS,
    WORDS,
    EndsOnItsOwn,
    FaultHostError,
    RunningFault,
    StepKind,
    kind_of,
    register,
)

__all__ = [
    "KINDS",
    "WORDS",
    "EndsOnItsOwn",
    "FaultHostError",
    "RunningFault",
    "StepKind",
    "kind_of",
    "register",
]
