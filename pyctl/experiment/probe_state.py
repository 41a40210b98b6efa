"""A probe while the experiment runs: its schedule (mode, interval, abort
guard) and its samples. Built from the probes the file's load parsed,
with the target's facts filled in (Probe.with_facts)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyctl.experiment.model import Experiment

PROBE_INTERVAL_S = 0.5  # a probe without its own interval


@dataclass
class ProbeState:
    name: str
    probe: Any
    interval: float
    continuous: bool  # sampled through every phase
    onchaos: bool  # sampled while a fault is active
    sot: bool
    eot: bool
    guard: int = 0  # after_failures of an abort guard (0: not a guard)
    in_a_row: int = 0
    samples: list[tuple[str, Any]] = field(default_factory=list)  # (phase, ProbeResult)


def build_probes(
    exp: Experiment, facts: dict[str, Any], popen: subprocess.Popen[Any] | None = None
) -> dict[str, ProbeState]:
    out: dict[str, ProbeState] = {}
    if not exp.probes:
        return out
    for name, parsed in exp.probes.items():
        p = parsed.with_facts(facts)  # parsed once, at load: only the facts go in
        if getattr(p, "target", False) is True and hasattr(p, "bind"):
            p.bind(int(facts["pid"]), popen)  # a process probe of the target itself
        mode = str(getattr(p, "mode", "continuous")).lower()
        iv = getattr(p, "interval", None)
        out[name] = ProbeState(
            name=name,
            probe=p,
            interval=float(iv) if isinstance(iv, (int, float)) and iv > 0 else PROBE_INTERVAL_S,
            continuous=mode == "continuous",
            onchaos=mode == "onchaos",
            sot=mode in ("sot", "edge"),
            eot=mode in ("eot", "edge"),
        )
    for a in exp.aborts:
        out[a.probe].guard = a.after_failures
    return out


__all__ = ["PROBE_INTERVAL_S", "ProbeState", "build_probes"]
