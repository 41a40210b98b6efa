"""Steady-state probes: measure one thing, compare it with a tolerance.

An experiment file names probes as TOML tables; probe_from_toml() turns
one into a Probe whose sample() never raises: a probe that cannot measure
(connection refused, a command that times out) is a failed sample with the
reason in `detail`. Words as Chaos Toolkit and LitmusChaos users know them:

    [steady_state.probes.health]        # where = "exp.toml:steady_state.probes.health"
    kind = "http"                       # http | prometheus | metric | command | process | nvml
    mode = "continuous"                 # sot | eot | edge | continuous | onchaos
    url = "http://127.0.0.1:8000/health"
    json_path = "breaker.state"
    tolerance = "closed"
    timeout = "2s"                      # each attempt
    retries = 1                         # attempts after a failed one
    interval = "1s"                     # between attempts, and between continuous samples
    initial_delay = "0s"                # before the first sample (the runner waits it)

Modes (Litmus): sot = start of test (before the faults), eot = end of test,
edge = both, continuous = every `interval` for the whole experiment,
onchaos = every `interval` while a fault is active. The runner schedules
samples by mode, interval and initial_delay; a probe only measures.

Tolerances: probes/tolerance.py, the one type every probe and the load
hypothesis's bounds share. Every error in a table is a ProbeError of one
line naming where.key, what is wrong and what to do. Probe kinds: http,
prometheus, metric (probes/http.py), command, process (probes/process.py),
nvml (probes/nvml.py), found by their word in KINDS.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pyctl.experiment.probes.base import MODES, Probe, ProbeResult, Value, _Probe, _Table
from pyctl.experiment.probes.http import HttpProbe, MetricProbe, PrometheusProbe
from pyctl.experiment.probes.nvml import NvmlProbe
from pyctl.experiment.probes.process import CommandProbe, ProcessProbe, _stat
from pyctl.experiment.probes.tolerance import ProbeError, Tolerance

# The probe kinds by their `kind` word: one class each, in its module.
KINDS: dict[str, type[_Probe]] = {
    c.kind: c
    for c in (HttpProbe, PrometheusProbe, MetricProbe, CommandProbe, ProcessProbe, NvmlProbe)
}


def probe_from_toml(
    name: str, table: dict[str, Any], where: str, *, ignore: Collection[str] = ()
) -> Probe:
    """One probe from its TOML table. `where` is "FILE:KEY" of the table
    (e.g. "exp.toml:steady_state.probes.health"); `ignore` names keys the
    caller reads itself (a runner's own keys), which are then not refused.
    Target facts (`{url}`, `{pid}`) may stay in it: checked against stand-ins
    now, filled in by the probe's with_facts() once the target runs."""
    if not isinstance(table, dict):
        raise ProbeError(f'{where}: a probe is a table (e.g. [probes.{name}] with kind = "http")')
    kind = table.get("kind")
    if kind is None:
        raise ProbeError(f"{where}: missing key 'kind' (add kind = one of {', '.join(KINDS)})")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProbeError(
            f"{where}.kind: {kind!r} is not a probe kind: use one of {', '.join(KINDS)}"
        )
    r = _Table(table, where, {"kind", *ignore})
    probe = KINDS[kind](name, r)
    r.finish()
    return probe


__all__ = [
    "KINDS",
    "MODES",
    "CommandProbe",
    "HttpProbe",
    "MetricProbe",
    "NvmlProbe",
    "Probe",
    "ProbeError",
    "ProbeResult",
    "ProcessProbe",
    "PrometheusProbe",
    "Tolerance",
    "Value",
    "probe_from_toml",
    "_stat",
]
