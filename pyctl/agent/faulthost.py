"""An experiment's fault steps on another node: the FaultHost that arms
a step through that node's agent (pyctl.experiment.agents.FleetHost
routes the steps that name one here, by module name: this floor is above
the experiment's).

Each step is one RemoteSession of one AgentClient per agent (connected at
the first step, closed at the end): armed when the agent answers, its
lease renewed by the client, its fires streamed back. Stopped by disarm
(an abort, a rollback, the run's end). A controller that dies stops
renewing, and each agent disarms within the step's lease; the kernel-side
deadline (the step's duration) holds even if the agent dies too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

from pyctl.agent.client import ARM_TIMEOUT_S, AgentClient, AgentError, RemoteSession
from pyctl.agent.pull import SNAPSHOT_DIR
from pyctl.api.errors import GpufaultError
from pyctl.api.evidence import merge_evidence
from pyctl.api.target import Target
from pyctl.experiment.agents import AgentRef
from pyctl.experiment.steps.base import FaultHostError
from pyctl.experiment.steps.fault import StepRequest


class AgentFault:
    """One step armed by an agent, as the runner's RunningFault."""

    def __init__(self, agent: str, h: RemoteSession, step: StepRequest) -> None:
        self.agent = agent  # FleetHost.armed routes by it
        self.h = h
        self.step = step
        self._stopper: threading.Thread | None = None

    @property
    def run_id(self) -> str:
        return self.h.run_id

    @property
    def mechanism(self) -> str:
        return self.h.mechanism

    @property
    def started_at(self) -> float:
        return self.h.armed_at

    @property
    def lines(self) -> list[str]:
        return [f"gpufault: agent {self.agent}: {self.h.ended_by}"] if self.h.ended_by else []

    def wait_armed(self, timeout: float) -> None:
        """Armed already: the agent answered once every probe was attached."""

    def stop(self) -> None:
        """Disarm on a thread: every step of an abort is told at once."""
        if self._stopper is None and self.h.active:
            self._stopper = threading.Thread(target=self.h.disarm, daemon=True,
                                             name="gf-agent-stop")  # fmt: skip
            self._stopper.start()

    def kill_after_grace(self) -> None:
        """Nothing to kill here: the agent's lease and the kernel's deadline end it."""

    def wait(self, timeout: float | None = None) -> bool:
        return self.h.wait(timeout)

    @property
    def ended_at(self) -> float | None:
        return self.h.ended_at

    @property
    def rc(self) -> int | None:
        return 0 if self.h.wait(0) else None

    def run_row(self) -> dict[str, object] | None:
        return {"ended": self.h.ended_at} if self.h.ended_at is not None else None

    def fires(self) -> list[tuple[str, float]]:
        return [(str(f.fault_id), float(f.wall)) for f in self.h.fired()]


class _Arming:
    """A step handed to launch(): armed in armed(), where the runner
    catches a refusal as the step's failure; an abort before that only
    marks it."""

    def __init__(self, agent: str, step: StepRequest) -> None:
        self.agent = agent  # FleetHost.armed routes by it
        self.step = step
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def kill_after_grace(self) -> None:
        """Nothing was started."""


class AgentFaultHost:
    """Fault steps through one agent."""

    def __init__(self, ref: AgentRef) -> None:
        self.ref = ref
        self.name = f"agent:{ref.name}"
        self.run_ids: list[str] = []
        self.sessions: list[RemoteSession] = []
        self._client: AgentClient | None = None
        self._lock = threading.Lock()

    def client(self) -> AgentClient:
        with self._lock:
            if self._client is None:
                self._client = AgentClient.connect(self.ref.url, **self.ref.connect_kw())
            return self._client

    def launch(self, step: StepRequest) -> _Arming:
        return _Arming(self.ref.name, step)

    def armed(self, pending: _Arming) -> AgentFault:
        """Armed when the agent answers (its probes attached), or
        FaultHostError with the agent's one line."""
        step = pending.step
        what = f"step {step.name!r} on agent {self.ref.name} ({self.ref.url})"
        if pending.stopped:
            raise FaultHostError(f"{what}: stopped before it was armed")
        target = Target(tid=step.tid) if step.tid else Target(pid=step.pid)
        try:
            h = self.client().arm(list(step.specs), target, duration=step.duration,
                                  lease_s=self.ref.lease_s,
                                  timeout=step.arm_timeout or ARM_TIMEOUT_S)  # fmt: skip
        except GpufaultError as e:
            raise FaultHostError(f"{what} could not be armed: {e}") from None
        self.run_ids.append(h.run_id)
        self.sessions.append(h)
        f = AgentFault(self.ref.name, h, step)
        if pending.stopped:  # the abort came while it armed
            f.stop()
        return f

    def start(self, step: StepRequest) -> AgentFault:
        return self.armed(self.launch(step))

    def pull_into(self, db: str) -> str:
        """This experiment's runs from the agent's store into `db`; the
        one line that says what came."""
        if not self.run_ids:
            return ""
        c = self.client()
        for h in self.sessions:
            # The agent says "ended" once the run row is closed: then it
            # is in the snapshot as done, not left out as running.
            h.wait(10)
        tmpd = tempfile.mkdtemp(prefix="gf-pull-", dir=SNAPSHOT_DIR)
        try:
            path = os.path.join(tmpd, "agent.db")
            c.pull_evidence(path)
            (st_,) = merge_evidence([path], db, skip_running=True, runs=set(self.run_ids))
            return st_.line().split(": ", 1)[1]
        finally:
            shutil.rmtree(tmpd, ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            try:
                c.close(disarm=True)
            except AgentError:
                pass


__all__ = ["AgentFault", "AgentFaultHost"]
