"""What every step kind of the method shares, and the registry.

A kind is one module of this package (fault, traffic, perturb, pressure)
that registers one StepKind: the [[method]] word that chooses it, how its
table is read (at load), what is checked or prepared before anything is
armed, how it is launched and armed, and what it adds to the evidence.
The runner (pyctl/experiment/run.py) asks the registry for a step's kind
and calls these; it has no branch per kind.

Every armed step is a RunningFault: stop() it, wait() for it, ask its
fires(); a step that ends on a thread of its own uses EndsOnItsOwn.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from pyctl.experiment.model import Experiment, Step
    from pyctl.experiment.reader import Reader


class FaultHostError(RuntimeError):
    """A step could not be armed (the child, or the service, said why, in one line)."""


class RunningFault(Protocol):
    @property
    def run_id(self) -> str: ...

    @property
    def started_at(self) -> float: ...  # when it was armed (time.time())

    def stop(self) -> None: ...  # every fault of the step stops firing within 1 s

    def wait(self, timeout: float | None = None) -> bool: ...  # True once ended

    def fires(self) -> list[tuple[str, float]]: ...  # (fault_id, wall) of each fire

    @property
    def ended_at(self) -> float | None: ...

    @property
    def rc(self) -> int | None: ...


class Run(Protocol):
    """What a step kind reads and writes of the running experiment
    (pyctl/experiment/run.py's Run is one): a protocol, so that the steps
    sit below the runner that calls them."""

    exp: Experiment
    host: Any  # the FaultHost that arms fault steps
    who: dict[int, tuple[int, int | None]]  # step idx -> (pid, tid) its faults go to
    lock: Any  # a threading.RLock
    launching: list[Any]  # children being started (an abort stops them too)
    traffic_bodies: dict[int, list[tuple[str, bytes]] | None]
    db_path: str
    admin_token: str | None


@dataclass
class StepRun:
    step: Step
    planned_start: float
    fault: RunningFault | None = None
    status: str = "planned"
    error: str = ""
    ended_at: float | None = None
    fires: list[tuple[str, float]] = field(default_factory=list)
    fault_pid: int | None = None  # where its faults went (the step's pid/tid)
    fault_tid: int | None = None
    # The target's own name of that thread, read when the step armed (a
    # thread renamed or gone later keeps the name it had), or the comm the
    # step was limited to; None: every thread of the process.
    thread_name: str | None = None


class EndsOnItsOwn:
    """wait(), ended_at and rc of a step that ends on a thread of its own
    (a traffic or a perturb step): it sets `_ended_at`, then `_done`."""

    _done: threading.Event
    _ended_at: float | None

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def ended_at(self) -> float | None:
        return self._ended_at

    @property
    def rc(self) -> int | None:
        return 0 if self._done.is_set() else None


class StepKind:
    """One kind of [[method]] step. Subclasses set the class attributes and
    override what they do differently; the defaults suit a step that needs
    nothing before it is armed."""

    name: ClassVar[str]  # Step.kind
    words: ClassVar[tuple[str, ...]]  # the [[method]] keys that choose it
    # Common [[method]] keys this kind refuses, and the one line why.
    refused: ClassVar[Collection[str]] = ()
    why: ClassVar[str] = ""

    def refuse(self, r: Reader, key: str, m: dict[str, Any]) -> None:
        for k in self.refused:
            if k in m:
                raise r.err(f"{key}.{k}", self.why)

    def parse(self, r: Reader, key: str, m: dict[str, Any], step: Step) -> Step:
        """The step with its kind's table read (step: timing and aim, read)."""
        raise NotImplementedError

    def prepare(self, run: Run, step: Step, facts: dict[str, Any]) -> None:
        """Before the experiment row is written: check the step's aim."""
        # lazy: pyctl.experiment.target (+1 module) only when this runs
        from pyctl.experiment.target import step_target

        run.who[step.idx] = step_target(run.exp, step, facts)

    def launch(self, run: Run, sr: StepRun, facts: dict[str, Any]) -> Any:
        """Start arming without waiting (steps due together arm in
        parallel); what it returns is handed to arm(). Default: nothing."""
        return None

    def arm(self, run: Run, sr: StepRun, pending: Any, facts: dict[str, Any]) -> Any:
        """The RunningFault, armed; FaultHostError when it cannot be."""
        raise NotImplementedError

    def armed_line(self, f: Any) -> str:
        """What the run's output says of it once armed."""
        return str(f.what)

    def spec(self, step: Step) -> dict[str, Any]:
        """What this kind adds to the step's evidence row."""
        return {}

    def check(self, f: Any) -> tuple[bool, dict[str, Any], str] | None:
        """After the run: did the step's own answers hold (traffic)? None: no check."""
        return None


KINDS: dict[str, StepKind] = {}  # Step.kind -> its kind
WORDS: dict[str, StepKind] = {}  # a [[method]] key -> the kind it chooses


def register(kind: StepKind) -> StepKind:
    KINDS[kind.name] = kind
    for w in kind.words:
        WORDS[w] = kind
    return kind


def kind_of(step: Step) -> StepKind:
    return KINDS[step.kind]


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
