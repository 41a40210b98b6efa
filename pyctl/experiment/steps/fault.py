"""Fault steps (a template or an inline fault), and where a fault runs:
the FaultHost interface and this host's implementation.

The runner never arms a fault itself. It hands a step (specs + target +
duration) to a FaultHost and gets back a RunningFault it can stop, wait
for and ask about its fires. LocalFaultHost runs each step as a library
session in a child controller (pyctl.api.IsolatedSession): the step's
specs go to the child as JSON on a pipe, and readiness and fires come
back as JSON lines, so each fault has its own engine, its own run row and
its own kernel deadline; a node agent serving the same two calls over the
network can replace it later (docs/experiments.md, "FaultHost").

Why a child process per step, not a session in this process: the
copilot's ptrace session and SIGCHLD mask stay out of the runner, steps
due together arm in parallel, and a crash of the runner cannot leave a
fault armed past its deadline: the deadline lives in BPF, and the child
disarms when its parent dies (its request pipe closes; PR_SET_PDEATHSIG).
The child is `python -I` with this package by absolute path (pyctl.paths):
nothing from the current directory or PYTHONPATH is imported as root.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pyctl import templates as T
from pyctl.exceptions import BadInput
from pyctl.experiment.model import ExperimentError
from pyctl.experiment.steps.base import (
    EndsOnItsOwn,
    FaultHostError,
    RunningFault,
    StepKind,
    register,
)
from pyctl.spec import FaultSpec, SpecError

if TYPE_CHECKING:
    from pyctl.api.session import IsolatedSession
    from pyctl.experiment.model import Step
    from pyctl.experiment.reader import Reader
    from pyctl.experiment.steps.base import Run, StepRun

STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL (the kernel detaches what is left)


@dataclass
class StepRequest:
    """What a FaultHost needs to arm one step."""

    idx: int
    name: str
    template: str | None  # "name@vN" or None for an inline fault
    sets: dict[str, str]
    fault: dict[str, object] | None
    specs: list[FaultSpec]
    duration: float
    pid: int
    tid: int | None = None
    # Seconds to wait for the armed line; None: the host's default. Why per
    # step: attaching to a large library (libtorch_cpu.so, 606k symbols)
    # takes far longer than a libcuda step.
    arm_timeout: float | None = None
    agent: str | None = None  # another node's agent ([agents.NAME]); None: here


class FaultHost(Protocol):
    name: str  # where faults run, for the evidence (e.g. "local:HOSTNAME")

    def start(self, step: StepRequest) -> RunningFault: ...


class LocalFault:
    """One step as a child controller: a library session in its own
    process (pyctl.api.IsolatedSession). The child gets the step's specs
    as JSON on a pipe and reports readiness and each fire as JSON lines:
    no command line is rebuilt from the spec and no banner is parsed."""

    def __init__(self, session: IsolatedSession, db_path: str, step: StepRequest) -> None:
        self.session = session
        self.db_path = db_path
        self.step = step

    @property
    def run_id(self) -> str:
        return self.session.run_id

    @property
    def mechanism(self) -> str:
        return self.session.mechanism

    @property
    def started_at(self) -> float:
        return self.session.started_at

    @property
    def lines(self) -> list[str]:
        """The child's stderr, then its error (the runner quotes the last)."""
        err = self.session.error
        return [*self.session.stderr_lines, *([f"gpufault: {err}"] if err else [])]

    def wait_armed(self, timeout: float) -> None:
        # lazy: pyctl.api (+1 module) only when this runs
        from pyctl.api import GpufaultError

        try:
            self.session.wait_armed(timeout)
        except GpufaultError as e:
            if not self.session.run_id and "not armed within" in str(e):
                why = f"not armed within {timeout:g}s"
                raise FaultHostError(f"step {self.step.name!r} {why}") from e
            raise FaultHostError(f"step {self.step.name!r} could not be armed: {e}") from e

    def stop(self) -> None:
        """SIGTERM: the controller disarms every spec (one map write each),
        releases held threads and detaches; SIGKILL after STOP_GRACE_S."""
        self.session.stop()

    def kill_after_grace(self) -> None:
        p = self.session.proc
        if p is not None and not self.session.wait(STOP_GRACE_S) and p.poll() is None:
            p.kill()

    def wait(self, timeout: float | None = None) -> bool:
        return self.session.wait(timeout)

    @property
    def ended_at(self) -> float | None:
        return self.session.ended_at

    @property
    def rc(self) -> int | None:
        return self.session.rc if self.session.wait(0) else None

    def run_row(self) -> dict[str, object] | None:
        """The child's runs row (ended: when it finished disarming and detaching)."""
        if not self.run_id:
            return None
        return _query_one(
            self.db_path,
            "SELECT started, ended, status, stats FROM runs WHERE run_id=?",
            (self.run_id,),
        )

    def fires(self) -> list[tuple[str, float]]:
        if not self.run_id:
            return []
        rows = _query(
            self.db_path,
            "SELECT fault_id, wall FROM faults WHERE run_id=? ORDER BY wall, seq",
            (self.run_id,),
        )
        return [(str(a), float(b)) for a, b in rows]  # type: ignore[arg-type]


def _connect(db_path: str) -> sqlite3.Connection:
    # Our own short-lived reader: the child writes the same file (WAL).
    c = sqlite3.connect(db_path, timeout=5)
    c.execute("PRAGMA busy_timeout=5000")
    return c


def _query(db_path: str, sql: str, params: tuple[object, ...]) -> list[tuple[object, ...]]:
    try:
        c = _connect(db_path)
    except sqlite3.Error:
        return []
    try:
        return c.execute(sql, params).fetchall()
    except sqlite3.Error:
        return []
    finally:
        c.close()


def _query_one(db_path: str, sql: str, params: tuple[object, ...]) -> dict[str, object] | None:
    try:
        c = _connect(db_path)
    except sqlite3.Error:
        return None
    try:
        cur = c.execute(sql, params)
        row = cur.fetchone()
        return dict(zip([d[0] for d in cur.description], row, strict=True)) if row else None
    except sqlite3.Error:
        return None
    finally:
        c.close()


@dataclass
class LocalFaultHost:
    """Faults on this machine, one child controller per step."""

    db_path: str
    arm_timeout: float = 60.0
    env: dict[str, str] = field(default_factory=dict)
    on_line: Callable[[str], None] | None = None
    name: str = field(default_factory=lambda: f"local:{os.uname().nodename}")

    def session(self, step: StepRequest) -> IsolatedSession:
        """The step as a library session: its specs, its target, its
        duration (the kernel-side deadline), its run row's kind."""
        # lazy: pyctl.api (+1 module) only when this runs
        from pyctl.api import Target

        # lazy: keeps pyctl.api.session (queue, +10 modules) off `--help`
        from pyctl.api.session import IsolatedSession, Settings

        target = Target(tid=step.tid) if step.tid else Target(pid=step.pid)
        kind = f"template:{step.template}" if step.template else "inject"
        settings = Settings(
            db=self.db_path,
            duration=step.duration,
            kind=kind,
            argv=("gpufault", "experiment", "step", step.name),
            arm_timeout=step.arm_timeout or self.arm_timeout,
        )
        return IsolatedSession(list(step.specs), target, settings, env=self.env or None)

    def launch(self, step: StepRequest) -> LocalFault:
        """Start the child, do not wait: steps due together arm in parallel
        (each child takes 1-3 s here to load BPF and seize the threads).
        Call it from a long-lived thread: PR_SET_PDEATHSIG fires when the
        thread that forked the child exits, not only the process."""
        return LocalFault(self.session(step).launch(), self.db_path, step)

    def armed(self, f: LocalFault) -> LocalFault:
        """Return once its faults are armed, or raise FaultHostError with
        the child's reason."""
        try:
            f.wait_armed(f.step.arm_timeout or self.arm_timeout)
        except BaseException:
            f.stop()
            f.kill_after_grace()
            raise
        return f

    def start(self, step: StepRequest) -> LocalFault:
        return self.armed(self.launch(step))


class FaultKind(StepKind):
    """A step of BPF faults: a template with its --set values, or one
    inline fault table; armed by the FaultHost in the step's process."""

    name = "fault"
    words = ("template", "fault")

    def prepare(self, run: Run, step: Step, facts: dict[str, Any]) -> None:
        """Its aim, and its libraries and functions resolved in that
        process now: a name it does not have is one line before the
        baseline, not a failed step after it."""
        super().prepare(run, step, facts)
        if step.agent is not None:
            return  # resolved by that node's agent when it arms (its one line)
        pid = run.who[step.idx][0]
        check_step(step, pid)

    def parse(self, r: Reader, key: str, m: dict[str, Any], step: Step) -> Step:
        sets: dict[str, str] = {}
        fault = None
        template = None
        if "template" in m:
            tname = r.str_(m, key, "template")
            s = m.get("set", {})
            if not isinstance(s, dict):
                raise r.err(f"{key}.set", "expected a table {knob = value, ...}")
            sets = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in s.items()}
            try:
                tpl = T.get(tname)
                specs = tpl.specs(sets)
            except T.TemplateError as e:
                raise r.err(f"{key}.template", f"{e}") from None
            template = tpl.ident
        else:
            if "set" in m:
                raise r.err(f"{key}.set", "set is for template steps: put the values in fault")
            f = m["fault"]
            if not isinstance(f, dict):
                raise r.err(f"{key}.fault", "expected a table {lib=..., fn=..., action=...}")
            for k in f:
                if k not in T.FAULT_FIELDS:
                    fields = ", ".join(sorted(T.FAULT_FIELDS))
                    raise r.err(
                        f"{key}.fault.{k}",
                        f"unknown field: use the [[fault]] fields of a template ({fields})",
                    )
            if f.get("entry_only"):
                raise r.err(f"{key}.fault.entry_only", "not for an injected fault: remove it")
            try:
                specs = [T.build_spec(dict(f))]
            except (SpecError, ValueError, KeyError) as e:
                raise r.err(f"{key}.fault", f"{e}") from None
            fault = dict(f)
        step.name = r.str_(
            m,
            key,
            "name",
            template.split("@")[0] if template else f"{specs[0].action} {specs[0].fn_text}",
        )
        step.template, step.sets, step.fault, step.specs = template, sets, fault, specs
        return step

    def request(self, run: Run, step: Step, facts: dict[str, Any]) -> StepRequest:
        # lazy: pyctl.experiment.target (+1 module) only when this runs
        from pyctl.experiment.target import thread_by_name

        pid, tid = run.who.get(step.idx, (int(facts["pid"]), None))
        if step.thread and step.agent is None:
            tid = thread_by_name(pid, step.thread)
        return StepRequest(
            idx=step.idx,
            name=step.name,
            template=step.template,
            sets=step.sets,
            fault=step.fault,
            specs=step.specs,
            duration=step.duration,
            pid=pid,
            tid=tid,
            arm_timeout=step.arm_timeout,
            agent=step.agent,
        )

    def launch(self, run: Run, sr: StepRun, facts: dict[str, Any]) -> Any:
        req = self.request(run, sr.step, facts)
        launch = getattr(run.host, "launch", None)
        if launch is None:
            return req  # a host that only starts: armed in arm()
        with run.lock:
            child = launch(req)
            run.launching.append(child)  # an abort stops it too, armed or not
        return child

    def arm(self, run: Run, sr: StepRun, pending: Any, facts: dict[str, Any]) -> Any:
        if isinstance(pending, StepRequest):
            return run.host.start(pending)
        return run.host.armed(pending)  # type: ignore[attr-defined]

    def armed_line(self, f: Any) -> str:
        return f"armed (run {f.run_id}"


register(FaultKind())


__all__ = [
    "EndsOnItsOwn",
    "FaultKind",
    "FaultHost",
    "RunningFault",
    "LocalFaultHost",
    "LocalFault",
    "StepRequest",
    "FaultHostError",
]


def check_step(step: Step, pid: int) -> list[str]:
    """Every spec of a fault step resolved in pid (pyctl.api.probes.
    check_specs); ExperimentError naming the step when one cannot be."""
    # lazy: the engine's planner only when a step is checked
    from pyctl.api.probes import check_specs

    if not step.specs:
        return []
    try:
        sites = check_specs(step.specs, pid)
    except BadInput as e:
        raise ExperimentError(f"step {step.idx + 1} ({step.name}) in pid {pid}: {e}") from None
    return [s.line() for s in sites]
