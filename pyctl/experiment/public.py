"""Experiments from Python: run one and get its verdict.

The experiment layer's public face (re-exported by the `gpufault`
package); it sits above the session API (pyctl.api), which its fault
steps use (pyctl/experiment/steps/fault.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pyctl.api.errors import BadInput, ExperimentFailed, GpufaultError, translate


@dataclass(frozen=True)
class ExperimentVerdict:
    """An experiment's outcome: verdict pass/fail, why, and where the
    evidence is (`gpufault experiment results ID --db DB`)."""

    verdict: str  # pass, fail (error and aborted raise ExperimentFailed)
    reason: str
    experiment_id: str
    db: str
    started_at: float
    ended_at: float
    exit_code: int
    fault_runs: list[str] = field(default_factory=list)  # each fault step's run id
    expected: str = "pass"  # the file's [expect] verdict
    # The verdict is the one the file expects (a declared fail, say), not
    # reached by a signal or through a target's death the file did not allow.
    as_expected: bool = True

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def __bool__(self) -> bool:
        return self.passed


def load_experiment(file_or_name: str | os.PathLike[str], **sets: Any) -> Any:
    """A shipped experiment by name, or a file, knobs set by keyword."""
    # lazy: keeps pyctl.experiment.load (+78 modules, ~400 ms) off `import gpufault`
    from pyctl.experiment import load as F

    # lazy: keeps pyctl.experiment.model (+57 modules, ~200 ms) off `import gpufault`
    from pyctl.experiment import model as M

    try:
        return F.load(str(file_or_name), {k: str(v) for k, v in sets.items()})
    except M.ExperimentError as e:
        raise BadInput(str(e)) from e


def run_experiment(
    experiment: Any,
    *,
    db: str | os.PathLike[str],
    echo: Any = None,
    raise_on_error: bool = True,
    **sets: Any,
) -> ExperimentVerdict:
    """Run an experiment (a shipped name, a file, or load_experiment()'s
    object): baseline, method, recovery, verdict. A pass or a fail is the
    returned verdict; an error or an abort raises ExperimentFailed (with
    raise_on_error=False they are returned too)."""
    # lazy: keeps pyctl.experiment.model (+57 modules, ~200 ms) off `import gpufault`
    from pyctl.experiment import model as M

    # lazy: keeps pyctl.experiment.run (+90 modules, ~400 ms) off `import gpufault`
    from pyctl.experiment import run as runner

    exp = experiment
    if isinstance(experiment, (str, os.PathLike)):
        exp = load_experiment(experiment, **sets)
    elif sets:
        raise BadInput("run_experiment: knobs go with a name or file, not a loaded experiment")
    if not isinstance(exp, M.Experiment):
        raise BadInput(f"run_experiment: {experiment!r} is not an experiment name, file or object")
    try:
        out = runner.run(exp, str(db), echo=echo or (lambda _s: None))
    except GpufaultError:
        raise
    except Exception as e:  # noqa: BLE001 - ExperimentError, StoreError: one line
        raise translate(e) from e
    v = ExperimentVerdict(
        verdict=out.verdict.verdict,
        reason=out.verdict.reason,
        experiment_id=out.experiment_id,
        db=str(db),
        started_at=out.started_at,
        ended_at=out.ended_at,
        exit_code=out.exit_code,
        fault_runs=[s.fault.run_id for s in out.steps if s.fault is not None],
        expected=out.expected,
        as_expected=out.as_expected,
    )
    if raise_on_error and v.verdict not in ("pass", "fail"):
        raise ExperimentFailed(f"experiment {v.experiment_id} {v.verdict}: {v.reason}")
    return v


__all__ = ["run_experiment", "load_experiment", "ExperimentVerdict"]
