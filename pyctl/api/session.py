"""A fault session: specs armed in one target until disarmed, its deadline,
or the target's end; live counters; the evidence of its fault IDs.

    with gpufault.arm(Fault.fail("libcuda", "cuMemAlloc_v2",
                                 ret="CUDA_ERROR_OUT_OF_MEMORY", nth=3),
                      pid, db="/var/lib/gpufault/qa.db", duration=30) as h:
        h.wait_fires(1, timeout=10)
        print(h.faults()[0].show())

Two ways to run it, one behaviour:

- in this process (default): the controller runs on a thread of its own
  ("gf-session"), so arm() works from any thread and inside an event loop,
  and no signal handler is installed. SIGCHLD is blocked in that thread and
  in the copilot's threads it starts (the copilot sleeps in sigtimedwait
  for its tracees' stops; other threads that leave SIGCHLD unblocked only
  delay a stop by at most 50 ms, docs/api.md). The copilot's dead-man
  timer is the one every gpufault run has: if this process hangs past a
  stall's end, the kernel kills it, so a hang never outlives its deadline.
- isolate=True: the same session in a child controller process
  (`python -I`, this package by absolute path, pyctl/api/child.py). It gets
  the specs as JSON on a pipe and reports readiness, fires and its end as
  JSON lines; it stops when this process dies (its stdin closes, and
  PR_SET_PDEATHSIG). Experiments run their fault steps this way.

Either way the kernel-side deadline (`duration`) holds even if the
controller is killed, and leaving the `with` block (an exception, Ctrl-C)
disarms and detaches everything.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyctl.api import errors as E
from pyctl.api.errors import (
    BadInput,
    EvidenceWriteError,
    GpufaultError,
    MissingPrerequisite,
    translate,
)
from pyctl.api.evidence import Evidence, FaultRecord
from pyctl.api.target import Target
from pyctl.paths import module_argv
from pyctl.spec import FaultSpec, SpecError, check_stack_copy

if TYPE_CHECKING:
    from pyctl.api.group import SessionGroup

# mechanism=: pyctl/engine's MECHANISMS (not imported: keeps the engine off `import gpufault`)
MECHANISMS = ("auto", "signal", "copilot")
ARM_TIMEOUT_S = 120.0  # attach to a 600k-symbol library takes ~20 s on a slow host
STOP_GRACE_S = 5.0  # isolated child: SIGTERM, then SIGKILL (the kernel detaches the rest)


@dataclass(frozen=True)
class Fire:
    """A fault as the session saw it fire (the row is in the store)."""

    fault_id: str
    wall: float
    function: str = ""
    tid: int = 0
    action: str = ""


@dataclass
class Counters:
    calls: int = 0  # matching calls the probes saw
    fires: int = 0  # faults fired (each has a fault ID in the store)
    lost: int = 0  # records the kernel could not hand over (ring full)
    unfinished: int = 0  # calls still in flight when the probes went


@dataclass(frozen=True)
class Settings:
    """How a session runs, besides its specs and target."""

    db: str
    duration: float = 0.0  # seconds; 0: until disarm() or the target's end
    kind: str = "api"  # the run row's kind (api, template:NAME@vN, experiment step ...)
    argv: tuple[str, ...] = ()  # recorded in the run row
    xids: bool = True
    max_db_bytes: int | None = None
    copilot_signal: int | None = None
    # How fails and stalls are carried out where BPF cannot write registers:
    # "auto" (the signal helper by trial, else the copilot), "signal" (the
    # helper or refuse), "copilot" (docs/copilot.md).
    mechanism: str = "auto"
    arm_timeout: float = ARM_TIMEOUT_S
    stack_copy_bytes: int | None = None  # None: the default (16 KiB); 0: frame pointers only

    def run_options(self, target_labels: tuple[tuple[str, Any], ...] = ()) -> Any:
        # lazy: keeps pyctl.run_options (+11 modules, ~100 ms) off `import gpufault`
        from pyctl.run_options import DEFAULT_MAX_DB_BYTES, RunOptions

        return RunOptions(
            db_path=self.db,
            kind=self.kind,
            argv=self.argv or ("gpufault-api", self.kind),
            duration=self.duration,
            copilot_signal=self.copilot_signal,
            mechanism=self.mechanism,
            quiet=True,
            xids=self.xids,
            max_db_bytes=DEFAULT_MAX_DB_BYTES if self.max_db_bytes is None else self.max_db_bytes,
            stack_copy_bytes=self.stack_copy_bytes,
            target_labels=tuple(target_labels),
        )

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Settings:
        d = dict(d)
        d["argv"] = tuple(d.get("argv") or ())
        return cls(**d)


def check_prerequisites() -> None:
    """Root (BPF and ptrace need it), checked before anything starts."""
    if os.geteuid() != 0:
        raise MissingPrerequisite(
            "gpufault arms faults with BPF and ptrace: run as root (or in a root harness)"
        )


def _specs(spec: FaultSpec | Iterable[FaultSpec]) -> list[FaultSpec]:
    specs = [spec] if isinstance(spec, FaultSpec) else list(spec)
    if not specs:
        raise BadInput("arm: give at least one fault (gpufault.Fault.fail(...), ...)")
    for s in specs:
        if not isinstance(s, FaultSpec):
            raise BadInput(f"arm: {s!r} is not a fault spec: build one with gpufault.Fault")
    return specs


class _Base:
    """What both kinds of session share: counters, fires, waiting."""

    def __init__(self, specs: list[FaultSpec], target: Target, settings: Settings) -> None:
        self.specs = specs
        self.target = target
        self.settings = settings
        self.run_id = ""
        self.mechanism = ""
        self.started_at = 0.0
        self.ended_at: float | None = None
        self.exit_code: int | None = None  # a started command's status
        self.status = "starting"  # armed, done, failed
        self.notices: list[str] = []  # what the controller would have printed
        self.error: GpufaultError | None = None
        self._counters = Counters()
        self._fires: list[Fire] = []
        self._cond = threading.Condition()
        self._armed = threading.Event()
        self._ended = threading.Event()
        self.on_fire: Callable[[Fire], None] | None = None

    # --- what the controller reports -------------------------------------
    def _fired(self, f: Fire) -> None:
        with self._cond:
            self._fires.append(f)
            self._counters.fires = max(self._counters.fires, len(self._fires))
            self._cond.notify_all()
        cb = self.on_fire
        if cb is not None:
            try:
                cb(f)
            except Exception as e:  # noqa: BLE001 - a harness's callback never ends the run
                self.notices.append(f"on_fire callback raised {type(e).__name__}: {e}")

    def _end(self) -> None:
        with self._cond:
            self.ended_at = self.ended_at or time.time()
            self._ended.set()
            self._cond.notify_all()

    # --- the public surface ------------------------------------------------
    @property
    def db(self) -> str:
        return self.settings.db

    @property
    def counters(self) -> Counters:
        """A snapshot: calls, fires, lost, unfinished."""
        c = self._counters
        return Counters(c.calls, c.fires, c.lost, c.unfinished)

    @property
    def calls(self) -> int:
        return self.counters.calls

    @property
    def fires(self) -> int:
        return self.counters.fires

    @property
    def lost(self) -> int:
        return self.counters.lost

    @property
    def unfinished(self) -> int:
        return self.counters.unfinished

    @property
    def active(self) -> bool:
        return self._armed.is_set() and not self._ended.is_set()

    def fired(self) -> list[Fire]:
        with self._cond:
            return list(self._fires)

    def wait_fires(self, n: int = 1, timeout: float | None = None) -> bool:
        """Block until `n` faults have fired (True), the timeout passes or
        the session ends first (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._fires) < n:
                if self._ended.is_set():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is None else min(left, 0.5))
            return True

    def wait(self, timeout: float | None = None) -> bool:
        """Until the session ended by itself (deadline, target's end): True."""
        return self._ended.wait(timeout)

    def faults(self) -> list[FaultRecord]:
        """This session's faults, from the store, in fire order."""
        if not self.run_id:
            return []
        with Evidence(self.db) as ev:
            return ev.faults(self.run_id)

    def summary(self, per_thread: bool = False) -> Any:
        """The run's call summary (pyctl.calls.summary.Summary: per function the
        calls, errors by code name, latency percentiles, a log2 histogram)
        from its call rows: a session of Fault.trace(...) specs records one
        per call. .to_json() is plain data, .render() `gpufault trace`'s text."""
        # lazy: keeps pyctl.calls.summary (+16 modules, ~200 ms) off `import gpufault`
        from pyctl.calls import summary

        # lazy: keeps pyctl.evidence.store (+10 modules) off `import gpufault`
        from pyctl.evidence import store

        try:
            d = store.open_db(self.db, readonly=True)
        except Exception as e:  # noqa: BLE001 - StoreError: one line
            raise translate(e) from e
        try:
            return summary.from_calls(d, self.run_id, per_thread=per_thread)
        except Exception as e:  # noqa: BLE001 - SummaryError
            raise translate(e) from e
        finally:
            d.close()

    def run_row(self) -> dict[str, Any]:
        with Evidence(self.db) as ev:
            return ev.run(self.run_id)

    def disarm(self) -> None:  # pragma: no cover - each kind has its own
        raise NotImplementedError

    def close(self) -> None:
        self.disarm()

    def __enter__(self) -> _Base:
        return self

    def __exit__(self, *_: object) -> None:
        self.disarm()

    def __repr__(self) -> str:
        c = self.counters
        return (
            f"<gpufault session run {self.run_id or '-'} {self.status} in "
            f"{self.target.describe()}: {c.calls} calls, {c.fires} fires, {c.lost} lost>"
        )


class Session(_Base):
    """The controller on a thread of this process."""

    def __init__(self, specs: list[FaultSpec], target: Target, settings: Settings) -> None:
        super().__init__(specs, target, settings)
        self._runner: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="gf-session", daemon=True)

    def start(self) -> Session:
        self._thread.start()
        if not self._armed.wait(self.settings.arm_timeout):
            self.disarm()
            raise GpufaultError(
                f"not armed within {self.settings.arm_timeout:g}s: "
                "raise arm_timeout for a large library"
            )
        if self.error is not None:
            self._thread.join()
            raise self.error
        return self

    def _main(self) -> None:
        # lazy: keeps pyctl.runner (+52 modules, ~400 ms) off `import gpufault`
        from pyctl.runner import Runner

        # lazy: keeps pyctl.sigmask (+1 module) off `import gpufault`
        from pyctl.sigmask import block_sigchld

        # This thread's mask is what the copilot's threads inherit.
        block_sigchld()
        runner = None
        try:
            runner = Runner(
                self.specs,
                self.target.to_runner(),
                self.settings.run_options(self.target.labels),
                echo=self.notices.append,
            )
            self._runner = runner
            eng = runner.start()
            self._hook(runner, eng)
            self.run_id, self.mechanism = eng.run_id, eng.mechanism
            self.started_at = time.time()
            self.status = "armed"
        except BaseException as e:  # noqa: BLE001 - reported to the arming thread
            self.error = translate(e)
            self.status = "refused"
            self._armed.set()
            self._end()
            return
        self._armed.set()
        end, rc = "done", None
        try:
            if self._stop.is_set():
                runner.request_stop()
            rc = runner.loop(handle_signals=False)
        except BaseException as e:  # noqa: BLE001 - StoreWriteError and the unexpected
            end = "failed"
            self.error = translate(e)
        finally:
            self._sample(runner)
            try:
                runner.finish(status=end, exit_code=rc if self.target.command else None)
            except BaseException as e:  # noqa: BLE001
                self.error = self.error or translate(e)
                end = "failed"
            closed = runner.engine
            if closed is not None and getattr(closed, "write_error", None) is not None:
                end = "failed"
                self.error = self.error or EvidenceWriteError(str(closed.write_error))
            self._sample(runner)
            self.exit_code = rc if self.target.command else None
            self.status = end
            self._end()

    def _hook(self, runner: Any, eng: Any) -> None:
        """Each fire reaches the harness once its row is committed (the
        engine calls on_fire after the batch's commit), so faults() after
        wait_fires() finds them all. The kernel's call counters are read on
        the controller's own thread, after a poll, about five times a second."""
        poll = eng.poll
        last = [0.0]

        def fired(row: dict[str, Any]) -> None:
            runner.note_fire(row)
            self._fired(_fire(row))

        def polled(*a: Any, **kw: Any) -> int:
            n = poll(*a, **kw)
            now = time.monotonic()
            if now - last[0] >= 0.2:
                last[0] = now
                try:
                    self._counters.calls = sum(c.calls for c in eng.counters())
                except Exception:  # noqa: BLE001 - counters are decoration until the end
                    pass
            return int(n)

        eng.on_fire = fired
        eng.poll = polled

    def _sample(self, runner: Any) -> None:
        eng = getattr(runner, "engine", None)
        if eng is None:
            return
        st = eng.stats
        c = self._counters
        c.calls, c.unfinished = st.calls, st.unfinished
        c.fires = max(c.fires, st.fires)
        try:
            lost = st.lost or eng.lost()
            c.lost = int(lost.get("events_lost", 0)) + int(lost.get("fires_lost", 0))
        except Exception:  # noqa: BLE001 - the maps are gone after close
            pass

    def release(self) -> int:
        """Let every thread a stall holds go now (`gpufault release`)."""
        eng = getattr(self._runner, "engine", None)
        cop = getattr(eng, "copilot", None)
        return int(cop.release(None)) if cop is not None else 0

    def disarm(self, timeout: float = 30.0) -> None:
        """Stop every fault, release held threads, detach; returns once the
        run row is closed. Safe to call twice and from any thread."""
        self._stop.set()
        r = self._runner
        if r is not None:
            r.request_stop()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


def _fire(row: dict[str, Any]) -> Fire:
    return Fire(
        fault_id=str(row["fault_id"]),
        wall=float(row.get("wall") or time.time()),
        function=str(row.get("function") or ""),
        tid=int(row.get("tid") or 0),
        action=str(row.get("action") or ""),
    )


class IsolatedSession(_Base):
    """The controller as a child process (pyctl/api/child.py)."""

    def __init__(
        self,
        specs: list[FaultSpec],
        target: Target,
        settings: Settings,
        *,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(specs, target, settings)
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr_lines: list[str] = []
        self._reader: threading.Thread | None = None

    def launch(self) -> IsolatedSession:
        """Start the child, do not wait for it to arm (steps due together
        arm in parallel). Call from a long-lived thread: PR_SET_PDEATHSIG
        fires when the thread that forked the child exits."""
        settings = self.settings.to_json()
        # The child runs in / (below): a relative db is the caller's, from
        # its own directory (`make demo-experiment`'s build/demo-experiment.db
        # was refused as "/build: no such directory").
        settings["db"] = db = os.path.abspath(settings["db"])
        request = {
            "specs": [s.to_json() for s in self.specs],
            "target": self.target.to_json(),
            "settings": settings,
            "parent": os.getpid(),
        }
        self.proc = _LAUNCHER.popen(
            # The db and kind in argv say in `ps` which controller writes
            # where (the child reads its request from stdin only).
            module_argv(
                "pyctl.api.child", ["--db", db, "--kind", self.settings.kind]
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_child_env(self.env),
            cwd="/",  # nothing of the caller's directory
            close_fds=True,
        )
        assert self.proc.stdin is not None
        # One line; stdin then stays open: its EOF is the child's signal that
        # this process is gone.
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        self._reader = threading.Thread(target=self._read, name="gf-session-child", daemon=True)
        self._reader.start()
        threading.Thread(target=self._drain_stderr, name="gf-session-err", daemon=True).start()
        return self

    def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for ln in self.proc.stderr:
            self.stderr_lines.append(ln.decode(errors="replace").rstrip("\n"))
            del self.stderr_lines[:-200]  # the last lines say why; a long run keeps no more

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            self._on_message(msg)
        self.proc.wait()
        if self.status in ("starting", "armed"):
            self.status = "failed" if self.proc.returncode else "done"
        if not self._armed.is_set():
            last = next((ln for ln in reversed(self.stderr_lines) if ln.strip()), "")
            self.error = self.error or GpufaultError(
                last.removeprefix("gpufault: ")
                or f"controller exited with status {self.proc.returncode} before arming"
            )
        self._armed.set()
        self._end()

    def _on_message(self, msg: dict[str, Any]) -> None:
        ev = msg.get("event")
        if ev == "armed":
            self.run_id, self.mechanism = str(msg["run_id"]), str(msg["mechanism"])
            self.started_at = float(msg["started_at"])
            self.status = "armed"
            self._armed.set()
        elif ev == "fire":
            self._fired(Fire(**{k: msg[k] for k in Fire.__dataclass_fields__ if k in msg}))
        elif ev == "counters":
            c = self._counters
            c.calls, c.lost, c.unfinished = msg["calls"], msg["lost"], msg["unfinished"]
            c.fires = max(c.fires, int(msg["fires"]))
        elif ev == "notice":
            self.notices.append(str(msg["text"]))
        elif ev == "error":
            cls = getattr(E, str(msg.get("type")), GpufaultError)
            if not (isinstance(cls, type) and issubclass(cls, GpufaultError)):
                cls = GpufaultError
            self.error = cls(str(msg["message"]))
        elif ev == "end":
            self.status = str(msg["status"])
            self.exit_code = msg.get("exit_code")
            self.ended_at = float(msg["ended_at"])

    def wait_armed(self, timeout: float | None = None) -> IsolatedSession:
        t = self.settings.arm_timeout if timeout is None else timeout
        if not self._armed.wait(t):
            self.disarm()
            raise GpufaultError(f"not armed within {t:g}s: raise arm_timeout for a large library")
        if self.error is not None and not self.run_id:
            self.disarm()
            raise self.error
        return self

    def start(self) -> IsolatedSession:
        return self.launch().wait_armed()

    @property
    def rc(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        """Ask the child to disarm (SIGTERM); returns at once. Not once it
        said it ended: a SIGTERM then lands in its interpreter's shutdown,
        after its handlers are gone, and turns a clean exit into -15."""
        p = self.proc
        if p is not None and p.poll() is None and self.ended_at is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def disarm(self, timeout: float = STOP_GRACE_S) -> None:
        self.stop()
        p = self.proc
        if p is None:
            return
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()  # the kernel detaches its probes; the BPF deadline holds
            p.wait()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        if p.stdin is not None:
            try:
                p.stdin.close()
            except OSError:
                pass


class _Launcher:
    """One long-lived thread forks every child controller. The child asks
    for PR_SET_PDEATHSIG, which the kernel sends when the *thread* that
    forked it exits: a session armed from asyncio.to_thread or a pool
    thread would otherwise lose its controller with that thread. SIGCHLD
    is blocked in it like in every controller thread (pyctl/sigmask.py)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.Queue[tuple[tuple[Any, ...], dict[str, Any], list[Any], threading.Event]]
        self._jobs = queue.Queue()
        self._thread: threading.Thread | None = None

    def popen(self, *args: Any, **kw: Any) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gf-launcher", daemon=True)
                self._thread.start()
        box: list[Any] = [None, None]
        done = threading.Event()
        self._jobs.put((args, kw, box, done))
        done.wait()
        if box[1] is not None:
            raise box[1]
        return box[0]  # type: ignore[no-any-return]

    def _run(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        while True:
            args, kw, box, done = self._jobs.get()
            try:
                box[0] = subprocess.Popen(*args, **kw)
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                box[1] = e
            finally:
                done.set()


_LAUNCHER = _Launcher()


# Variables a child controller must not take from the caller: what Python
# reads at start (isolated mode ignores PYTHON*, but not LD_*), and what
# would point gpufault at another user's directory.
_DROP_PREFIXES = ("PYTHON", "LD_", "GPUFAULT_NO_SERVER")


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP_PREFIXES)}
    env.update(extra or {})
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _settings(
    db: str | os.PathLike[str], duration: float, kind: str, xids: bool,
    max_db_bytes: int | None, copilot_signal: int | None, arm_timeout: float,
    stack_copy_bytes: int | None, mechanism: str = "auto",
) -> Settings:  # fmt: skip
    """A session's Settings from arm()'s keywords, checked (BadInput), and
    the host's prerequisites (MissingPrerequisite)."""
    if duration < 0:
        raise BadInput(f"duration: {duration:g} is negative: give seconds, or 0 for no limit")
    if not db:
        raise BadInput("db: give the evidence database's path")
    if mechanism not in MECHANISMS:
        raise BadInput(f"mechanism: {mechanism!r} is not one of {', '.join(MECHANISMS)}")
    if stack_copy_bytes is not None:
        try:
            check_stack_copy(stack_copy_bytes, "stack_copy_bytes")
        except SpecError as e:
            raise BadInput(str(e)) from None
    check_prerequisites()
    return Settings(
        db=str(db),
        duration=float(duration),
        kind=kind,
        argv=("gpufault-api", *sys.argv[:1]),
        xids=xids,
        max_db_bytes=max_db_bytes,
        copilot_signal=copilot_signal,
        mechanism=mechanism,
        arm_timeout=arm_timeout,
        stack_copy_bytes=stack_copy_bytes,
    )


def arm(
    spec: FaultSpec | Sequence[FaultSpec],
    target: Target | int | Sequence[str],
    *,
    db: str | os.PathLike[str],
    duration: float = 0.0,
    isolate: bool = False,
    kind: str = "api",
    xids: bool = True,
    max_db_bytes: int | None = None,
    copilot_signal: int | None = None,
    arm_timeout: float = ARM_TIMEOUT_S,
    on_fire: Callable[[Fire], None] | None = None,
    stack_copy_bytes: int | None = None,
    mechanism: str = "auto",
) -> Session | IsolatedSession:
    """Arm `spec` (one FaultSpec or several) in `target` (a pid, an argv
    list, or a Target) and return once every probe is attached and the
    faults can fire. Raises a GpufaultError subclass (BadInput,
    MissingPrerequisite, TargetGone) with nothing left behind."""
    specs = _specs(spec)
    tgt = Target.of(target)
    settings = _settings(db, duration, kind, xids, max_db_bytes, copilot_signal, arm_timeout,
                         stack_copy_bytes, mechanism)  # fmt: skip
    if tgt.selector or tgt.thread_name:
        members = tgt.members(sorted({sp.lib for sp in specs if sp.lib}))
        if len(members) > 1:
            raise BadInput(
                f"{tgt.describe()} is {len(members)} processes "
                f"({', '.join(str(m.pid) for m in members[:8])}): arm them with "
                "gpufault.arm_all(), which returns a SessionGroup"
            )
        tgt = members[0]
    s: Session | IsolatedSession
    s = IsolatedSession(specs, tgt, settings) if isolate else Session(specs, tgt, settings)
    s.on_fire = on_fire
    return s.start()


def arm_all(
    spec: FaultSpec | Sequence[FaultSpec],
    target: Target,
    *,
    db: str | os.PathLike[str],
    duration: float = 0.0,
    kind: str = "api",
    xids: bool = True,
    max_db_bytes: int | None = None,
    copilot_signal: int | None = None,
    arm_timeout: float = ARM_TIMEOUT_S,
    on_fire: Callable[[Fire], None] | None = None,
    stack_copy_bytes: int | None = None,
    mechanism: str = "auto",
) -> SessionGroup:
    """Arm `spec` in every process `target` selects (Target.container,
    .cgroup, .pod, .comm, .ranks_of, .threads; a plain pid is a group of
    one): one isolated session each, armed in parallel, all or nothing.
    Returns a SessionGroup; raises like arm() with nothing left behind."""
    # lazy: pyctl.api.group only for a target of several processes
    from pyctl.api.group import SessionGroup

    specs = _specs(spec)
    if not isinstance(target, Target) or target.command:
        raise BadInput(
            "arm_all: give a gpufault.Target of running processes "
            "(Target.container(NAME), .comm(NAME), .ranks_of(PID), .process(PID))"
        )
    settings = _settings(db, duration, kind, xids, max_db_bytes, copilot_signal, arm_timeout,
                         stack_copy_bytes, mechanism)  # fmt: skip
    members = target.members(sorted({sp.lib for sp in specs if sp.lib}))
    group = SessionGroup([IsolatedSession(specs, m, settings) for m in members])
    return group.arm_all(on_fire)


__all__ = [
    "arm",
    "arm_all",
    "Session",
    "IsolatedSession",
    "Settings",
    "Counters",
    "Fire",
    "check_prerequisites",
]
