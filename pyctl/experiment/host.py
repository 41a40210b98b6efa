"""Where a fault runs: the FaultHost interface, and this host's implementation.

The runner never arms a fault itself. It hands a step (specs + target +
duration) to a FaultHost and gets back a RunningFault it can stop, wait
for and ask about its fires. Today LocalFaultHost runs each step as a
child `python -m pyctl template run|inject ... --duration D -q` on this
machine, so each fault has its own engine, its own run row and its own
kernel deadline; a node agent serving the same two calls over the network
can replace it later (docs/experiments.md, "FaultHost").

Why a child process per step, not an Engine in this process: a step is
then exactly what `gpufault inject` does (the same checks, the same
evidence, the same cleanup on SIGTERM), the copilot's ptrace session and
SIGCHLD mask stay out of the runner, and a crash of the runner cannot
leave a fault armed past its deadline: the deadline lives in BPF, and the
child is told to stop when its parent dies (PR_SET_PDEATHSIG, below).
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from pyctl import paths
from pyctl.spec import FaultSpec

# `Injecting ... [run 1a2b3c4d, mechanism copilot] ... Ctrl-C to end`: the
# controller prints it once every spec is armed (pyctl/cli.py _run_engine).
ARMED = re.compile(r"\[run ([0-9a-f]+), mechanism (\w+)\].*Ctrl-C to end")
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL (the kernel detaches what is left)

_REPO = str(Path(__file__).resolve().parent.parent.parent)


def child_argv(args: list[str], python: str = sys.executable) -> list[str]:
    """`python -m pyctl ARGS`, isolated (pyctl.paths.module_argv: never a
    module from the cwd or PYTHONPATH), dying with SIGTERM when this
    process dies."""
    return paths.module_argv("pyctl", args, die_with=os.getpid(), python=python)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: ours, unbuffered. PYTHONPATH names this
    checkout first for a target.command that runs `python -m pyctl...`
    itself (gpufault's own children are isolated and ignore it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH", "")) if p)
    return env


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


class FaultHostError(RuntimeError):
    """A step could not be armed (the child said why, in one line)."""


class RunningFault(Protocol):
    run_id: str
    started_at: float  # when it was armed (time.time())

    def stop(self) -> None: ...  # every fault of the step stops firing within 1 s

    def wait(self, timeout: float | None = None) -> bool: ...  # True once ended

    def fires(self) -> list[tuple[str, float]]: ...  # (fault_id, wall) of each fire

    @property
    def ended_at(self) -> float | None: ...

    @property
    def rc(self) -> int | None: ...


class FaultHost(Protocol):
    name: str  # where faults run, for the evidence (e.g. "local:HOSTNAME")

    def start(self, step: StepRequest) -> RunningFault: ...


def inject_args(fault: dict[str, object]) -> list[str]:
    """An inline [[fault]] table as `gpufault inject` options. The table was
    already built by templates.build_spec (the spec that is recorded);
    tests/test_experiment_files.py checks both give the same spec."""
    out = ["--lib", str(fault["lib"])]
    fns = fault["fn"] if isinstance(fault["fn"], list) else [fault["fn"]]
    for f in fns:
        out += ["--fn", str(f)]
    out += ["--action", str(fault.get("action", "observe"))]
    for k in (
        "ret",
        "mode",
        "signal",
        "corrupt",
        "stall",
        "nth",
        "every",
        "after",
        "max",
        "prob",
        "when",
        "window",
        "caller",
    ):
        v = fault.get(k)
        if v in (None, "") or (k == "stall" and not v):
            continue
        out += [f"--{k}", str(v)]
    for k, flag in (("sticky", "--sticky"), ("trace", "--trace"), ("no_stack", "--no-stack")):
        if fault.get(k):
            out.append(flag)
    return out


class LocalFault:
    """One step as a child controller process."""

    def __init__(self, proc: subprocess.Popen[str], db_path: str, step: StepRequest) -> None:
        self.proc = proc
        self.db_path = db_path
        self.step = step
        self.run_id = ""
        self.mechanism = ""
        self.started_at = 0.0
        self.lines: list[str] = []
        self._ended_at: float | None = None
        self._exited = threading.Event()
        self._armed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="gf-exp-step", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for ln in self.proc.stderr:
            self.lines.append(ln.rstrip("\n"))
            if not self.run_id and (m := ARMED.search(ln)):
                self.run_id, self.mechanism = m.group(1), m.group(2)
                self.started_at = time.time()
                self._armed.set()
        self.proc.wait()
        self._ended_at = time.time()
        self._exited.set()
        self._armed.set()

    def wait_armed(self, timeout: float) -> None:
        if not self._armed.wait(timeout):
            self.stop()
            raise FaultHostError(f"step {self.step.name!r} not armed within {timeout:g}s")
        if not self.run_id:
            last = next((ln for ln in reversed(self.lines) if ln.strip()), "")
            last = last.removeprefix("gpufault: ")
            raise FaultHostError(
                f"step {self.step.name!r} could not be armed: "
                f"{last or f'exit status {self.proc.returncode}'}"
            )

    def stop(self) -> None:
        """SIGTERM: the controller disarms every spec (one map write each),
        releases held threads and detaches; SIGKILL after STOP_GRACE_S."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill_after_grace(self) -> None:
        if not self._exited.wait(STOP_GRACE_S) and self.proc.poll() is None:
            self.proc.kill()

    def wait(self, timeout: float | None = None) -> bool:
        return self._exited.wait(timeout)

    @property
    def ended_at(self) -> float | None:
        return self._ended_at

    @property
    def rc(self) -> int | None:
        return self.proc.returncode if self._exited.is_set() else None

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
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    on_line: Callable[[str], None] | None = None
    name: str = field(default_factory=lambda: f"local:{os.uname().nodename}")

    def argv(self, step: StepRequest) -> list[str]:
        who = ["--tid", str(step.tid)] if step.tid else ["--pid", str(step.pid)]
        common = [*who, "--db", self.db_path, "--duration", f"{step.duration:g}s", "-q"]
        if step.template:
            sets = [a for k, v in step.sets.items() for a in ("--set", f"{k}={v}")]
            return ["template", "run", step.template, *sets, *common]
        assert step.fault is not None
        return ["inject", *inject_args(step.fault), *common]

    def launch(self, step: StepRequest) -> LocalFault:
        """Start the child, do not wait: steps due together arm in parallel
        (each child takes 1-3 s here to load BPF and seize the threads).
        Call it from a long-lived thread: PR_SET_PDEATHSIG fires when the
        thread that forked the child exits, not only the process."""
        proc = subprocess.Popen(
            child_argv(self.argv(step), self.python),
            env=child_env(self.env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        return LocalFault(proc, self.db_path, step)

    def armed(self, f: LocalFault) -> LocalFault:
        """Return once its faults are armed (its start-up line), or raise
        FaultHostError with the child's reason."""
        try:
            f.wait_armed(f.step.arm_timeout or self.arm_timeout)
        except BaseException:
            f.stop()
            f.kill_after_grace()
            raise
        return f

    def start(self, step: StepRequest) -> LocalFault:
        return self.armed(self.launch(step))


__all__ = [
    "FaultHost",
    "RunningFault",
    "LocalFaultHost",
    "LocalFault",
    "StepRequest",
    "FaultHostError",
    "inject_args",
    "child_argv",
    "child_env",
]
