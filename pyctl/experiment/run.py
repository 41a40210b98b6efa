"""Run one experiment: baseline -> method -> recovery -> after, rollbacks always.

    baseline   load + probes for `phases.baseline`; start-of-test probes at its end
               (the hypothesis "before": if it does not hold, nothing is armed)
    method     steps at their offsets, each armed by its kind (pyctl/experiment/steps/:
               fault, traffic, perturb, pressure), continuous and onchaos probes,
               abort guards (N failures in a row stop every fault at once)
    recovery   load and probes go on for `phases.recovery` after the last fault ended
    after      end-of-test probes; then the load stops
    rollback   always: on success, on abort, on Ctrl-C/SIGTERM, on an exception

Every check of the target (URL reachable, process running, thread found,
probes buildable) happens before the experiment row is written or a fault
armed. The verdict is computed at the end from what was recorded
(pyctl/experiment/evaluate.py); the target is pyctl/experiment/target.py,
rollbacks and the remediation hook pyctl/experiment/rollback.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyctl.evidence import store
from pyctl.experiment import corpora
from pyctl.experiment import evidence as E
from pyctl.experiment.evaluate import Evaluation
from pyctl.experiment.metrics_feed import MetricsFeed
from pyctl.experiment.model import ADMIN_TOKEN_ENV, Experiment, ExperimentError
from pyctl.experiment.probe_state import ProbeState, build_probes
from pyctl.experiment.rollback import Remedy, rollbacks
from pyctl.experiment.steps import FaultHostError, kind_of
from pyctl.experiment.steps.base import StepRun
from pyctl.experiment.steps.fault import FaultHost, LocalFaultHost
from pyctl.experiment.target import PidWatch, died, start_target
from pyctl.experiment.verdict import Verdict, expected_exit


def thread_name(pid: int | None, tid: int | None) -> str | None:
    """/proc/PID/task/TID/comm: the name the target gave the thread (what
    top -H and gdb show); None without a tid or once the thread is gone."""
    if not tid:
        return None
    try:
        with open(f"/proc/{pid or tid}/task/{tid}/comm", "rb") as fh:
            return fh.read(64).decode(errors="replace").rstrip("\n") or None
    except OSError:
        return None


@dataclass
class Outcome:
    experiment_id: str
    verdict: Verdict
    db_path: str
    started_at: float
    ended_at: float
    abort_at: float | None
    steps: list[StepRun]
    expected: str = "pass"  # the file's [expect] verdict
    interrupted: str | None = None  # the signal that ended the run, if one did
    died: bool = False  # the target died, and the file does not say it may
    # Each load/quality hypothesis term checked: (term, phase, value, ok).
    slo: list[tuple[str, str, float, bool]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """The verdict's own status (0 pass, 1 fail, 2 error, 3 aborted)."""
        return self.verdict.exit_code

    @property
    def as_expected(self) -> bool:
        return self.expected_exit == 0

    @property
    def expected_exit(self) -> int:
        """The CLI's status: 0 when the verdict is the one the file expects."""
        return expected_exit(
            self.verdict.verdict, self.expected, self.interrupted is not None, self.died
        )


class Run(Evaluation):
    def __init__(
        self,
        exp: Experiment,
        db_path: str,
        *,
        host: FaultHost | None = None,
        echo: Callable[[str], None] = print,
        metrics: Any = None,
    ) -> None:
        self.exp = exp
        self.db_path = db_path
        self.metrics = metrics  # pyctl.observe.metrics.Metrics or None
        self.slo_values: list[tuple[str, str, float, bool]] = []
        self.quality: Any = None  # a quality.QualityProbe for a file with [quality]
        self.host: FaultHost = host or LocalFaultHost(db_path)
        if exp.agents and host is None:
            # lazy: pyctl.experiment.agents only for a file that names agents
            from pyctl.experiment.agents import FleetHost

            self.host = FleetHost(self.host, exp.agents, db_path)
        self.echo = echo
        self.phase = "baseline"
        # Reentrant: the SIGINT handler runs on the main thread, maybe inside it.
        self.lock = threading.RLock()
        self.stop_event = threading.Event()  # abort or interrupt: end the method now
        self.done_event = threading.Event()  # the run is over: probe threads end
        self.abort_at: float | None = None
        self.abort_reason: str | None = None
        self.abort_probe = ""
        self.launching: list[Any] = []  # children started, not yet armed
        self.interrupted: str | None = None
        self.steps: list[StepRun] = []
        self.rec = E.Record()
        self.faults_active = 0
        self.phase_at: dict[str, float] = {}
        self.remedy = Remedy(exp, self.rec, echo)  # the breach's remediation hook, once
        self.who: dict[int, tuple[int, int | None]] = {}  # step idx -> (pid, tid)
        self.admin_token: str | None = None  # what perturb steps send (start_target's)
        self.traffic_bodies: dict[int, list[tuple[str, bytes]] | None] = {}
        self.pid_watch: PidWatch | None = None  # a target given by pid

    # -- abort: called from a guard probe's thread, stops every fault at once
    def abort(self, why: str, probe: str, at: float | None = None) -> None:
        """at: the decision (now), not the failing sample's start."""
        at = time.time() if at is None else at
        with self.lock:
            if self.abort_at is not None:
                return
            self.abort_at, self.abort_reason, self.abort_probe = at, why, probe
            running = [s.fault for s in self.steps if s.fault is not None] + self.launching
        for f in running:
            f.stop()  # SIGTERM to each first, then wait: all stop together
        self.stop_event.set()

    def _interrupt(self, signum: int, _frame: Any) -> None:
        self.interrupted = signal.Signals(signum).name
        with self.lock:
            running = [s.fault for s in self.steps if s.fault is not None] + self.launching
        for f in running:
            f.stop()
        self.stop_event.set()

    def _probe_loop(self, ps: ProbeState) -> None:
        delay = float(getattr(ps.probe, "initial_delay", 0.0) or 0.0)
        if delay and self.done_event.wait(delay):
            return
        while not self.done_event.is_set():
            phase = self.phase
            active = (
                ps.continuous
                or (ps.onchaos and self.faults_active > 0)
                or (ps.guard and phase == "fault")
            )
            if active and phase != "after":
                self._sample(ps, phase)
            self.done_event.wait(ps.interval)

    def _sample(self, ps: ProbeState, phase: str) -> Any:
        try:
            res = ps.probe.sample()
        except Exception as e:  # noqa: BLE001 - a probe's bug is a failed sample
            # lazy: only when a probe raised
            from pyctl.experiment.probes import ProbeResult

            res = ProbeResult(False, None, f"probe raised {type(e).__name__}: {e}", time.time())
        ps.samples.append((phase, res))
        if ps.guard and phase == "fault":
            ps.in_a_row = 0 if res.ok else ps.in_a_row + 1
            if ps.in_a_row >= ps.guard:
                self.abort(
                    f"guard probe {ps.name} failed {ps.in_a_row} times in a row ({res.detail})",
                    ps.name,
                )
        if not res.ok and phase == "fault" and ps.name in self.exp.steady.probes:
            self.remedy.breach(res.at, f"probe {ps.name}: {res.detail}", self.phase_at["baseline"])
        return res

    def _wait(self, until: float) -> bool:
        """Wait for a moment, or an abort/interrupt (True)."""
        return self.stop_event.wait(max(0.0, until - time.time()))

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_at[phase] = time.time()
        if self.metrics is not None:
            self.metrics.set_phase(phase)

    def _step_runs(self) -> list[str]:
        with self.lock:
            return [s.fault.run_id for s in self.steps if s.fault is not None and s.fault.run_id]

    def _active(self, delta: int) -> None:
        with self.lock:
            self.faults_active += delta
            n = self.faults_active
        if self.metrics is not None:
            self.metrics.set_faults_active(n)

    def execute(self) -> Outcome:
        exp = self.exp
        # BPF uprobes and ptrace need root; traffic, perturb and pressure steps do not.
        faults = [s for s in exp.steps if s.specs and s.agent is None and s.agent_select is None]
        if faults and os.geteuid() != 0 and isinstance(
            getattr(self.host, "local", self.host), LocalFaultHost
        ):
            raise ExperimentError(
                f"{exp.path}: method: its faults need root here (BPF uprobes, ptrace): "
                "run gpufault experiment as root"
            )
        # The database first (store.open_db's checks: StoreError, exit 2),
        # removed again if this run created it and then refuses to start.
        ev = E.Evidence(self.db_path)
        proc = None
        load = None
        probe_threads: list[threading.Thread] = []
        old: dict[int, Any] = {}
        xid = ""
        try:
            # Header secrets read from the environment first: a missing one is
            # one line before anything starts (and the values live only here).
            load_headers = exp.load.resolved_headers(str(exp.path)) if exp.load else {}
            for st in exp.steps:
                if st.traffic is not None:
                    st.traffic.resolved_headers(f"{exp.path}: traffic step {st.name!r}")
            prepare = getattr(self.host, "prepare", None)
            if prepare is not None:  # every agent reached and checked, before anything starts
                prepare(exp.steps, self.echo)
            proc, facts = start_target(exp)
            # A service it started: its token; one given by url: GPUFAULT_ADMIN_TOKEN.
            self.admin_token = (proc.admin_token if proc is not None else None) or os.environ.get(
                ADMIN_TOKEN_ENV
            )
            if proc is None:
                # A target given by pid: gpufault cannot wait() for it, so a
                # pidfd tells when it ends (its signal: from the evidence).
                self.pid_watch = PidWatch(int(facts["pid"]))
            for s in exp.steps:
                kind_of(s).prepare(self, s, facts)  # its aim checked, its bodies made
            probes = build_probes(exp, facts, proc.proc if proc is not None else None)
            if exp.load is not None:
                # lazy: pyctl.experiment.loadgen (queue, +5 modules) only when this runs
                from pyctl.experiment.loadgen import OpenLoopLoad

                L = exp.load
                # Enough distinct bodies for a cold corpus over the whole run.
                span = exp.warmup + exp.baseline + exp.method_window + exp.recovery + 5
                load = OpenLoopLoad(
                    L.endpoint(facts["url"]),
                    L.rate,
                    prompt=L.prompt,
                    max_tokens=L.max_tokens,
                    timeout=L.timeout,
                    concurrency=L.concurrency,
                    bodies=corpora.bodies(L, L.expected_requests(span)),
                    method=L.method,
                    headers=load_headers,
                    stream=L.stream,
                    arrival=L.arrival,
                    realtime=L.realtime,
                )
            if exp.quality is not None:
                # lazy: pyctl.experiment.quality (http.client) only for a file with [quality]
                from pyctl.experiment.quality import QualityProbe

                self.quality = QualityProbe.build(exp.quality, facts["url"], exp.load, load_headers)
            xid = ev.start(exp, self.host.name)
            if self.metrics is not None:
                self.metrics.set_run(xid)
            started = time.time()
            self.echo(
                f"experiment {xid}: {exp.ident} against {facts['url']} (pid "
                f"{facts['pid']}) -> {self.db_path}"
            )
            if exp.load is not None and exp.load.arrival is not None:
                # The seed of a poisson load is in the evidence (settings.file)
                # and here, so a run can be repeated with `seed = N`.
                self.echo(f"  load: {exp.load.plan().describe()}")
            if threading.current_thread() is threading.main_thread():
                old = {
                    n: signal.signal(n, self._interrupt) for n in (signal.SIGINT, signal.SIGTERM)
                }
            failed: Exception | None = None
            feed = None
            if self.metrics is not None:  # the steps' fires, read back from the database
                feed = MetricsFeed(self.db_path, self.metrics, self._step_runs).start()
            burns = None
            if self.metrics is not None and exp.slos and load is not None and exp.load:
                # lazy: pyctl.experiment.burn_feed only for a file with [[slo]] and --metrics-addr
                from pyctl.experiment.burn_feed import BurnFeed

                burns = BurnFeed(exp.slos, load, self.metrics, lambda: self.phase_at.get(
                    "baseline"), self._phase_of, settle=exp.load.timeout).start()  # fmt: skip
            try:
                self._phases(facts, probes, load, probe_threads)
            except Exception as e:  # noqa: BLE001 - cleaned up, recorded, raised below
                failed = e
            finally:
                self._stop_faults()
                finish = getattr(self.host, "finish", None)
                if finish is not None:  # the agents' evidence into this store
                    finish(self.echo)
                self.done_event.set()
                if load is not None:
                    load.stop()
                for th in probe_threads:
                    th.join(10)
                rollbacks(exp, self.rec, self.echo)
                self.remedy.join()
                for signum, h in old.items():
                    signal.signal(signum, h)
                if feed is not None:
                    feed.stop()  # a last look: every fire counted before the verdict
                if burns is not None:
                    burns.stop()
            if proc is not None and proc.proc.poll() is not None:
                self.target_died = died(proc)
                self.echo(f"  {self.target_died}")
            elif self.pid_watch is not None:
                self.pid_watch.stop()
                if self.pid_watch.died_at is not None:
                    self.target_died = self._pid_died(self.pid_watch)
                    self.echo(f"  {self.target_died}")
            if failed is not None:
                why = f"the runner failed in phase {self.phase}: {type(failed).__name__}: {failed}"
                ev.finish("error", why, E.Record())
                raise failed
            try:
                verdict = self._evaluate(probes, load)
            except Exception as e:
                # A bug here must not leave the row "running": say so, then
                # let the error contract report it (exit 70).
                ev.finish("error", f"the runner failed: {type(e).__name__}: {e}", E.Record())
                raise
            ev.finish(verdict.verdict, verdict.reason, self.rec)
            if self.metrics is not None:
                for term, phase, value, ok in self.slo_values:
                    self.metrics.set_slo(term, phase, value, ok)
                for peak in getattr(self, "slo_burn_peaks", ()):
                    self.metrics.set_burn(*peak)
                self.metrics.set_verdict(verdict.verdict)
            ended = time.time()
            return Outcome(
                xid, verdict, self.db_path, started, ended, self.abort_at, self.steps,
                expected=self.exp.expect.verdict, interrupted=self.interrupted,
                died=bool(getattr(self, "target_died", None))
                and not self.exp.expect.target_may_die,
                slo=list(self.slo_values),
            )  # fmt: skip
        finally:
            if self.pid_watch is not None:
                self.pid_watch.stop()
            ev.close()
            if not xid and ev.created:
                store.remove_db(Path(self.db_path))  # refused: leave no file
            if proc is not None:
                t_stop = time.time()
                rc = proc.stop()
                self.echo(f"  target stopped (exit status {rc}) in {time.time() - t_stop:.1f}s")

    def _phases(
        self,
        facts: dict[str, Any],
        probes: dict[str, ProbeState],
        load: Any,
        threads: list[threading.Thread],
    ) -> None:
        exp = self.exp
        self._set_phase("baseline")
        if load is not None:
            load.start()
            # Warm-up: the first requests of a fresh service (and of the load
            # generator's connections) are slower; they are not the baseline.
            if exp.warmup and self._wait(time.time() + exp.warmup):
                return
            self._set_phase("baseline")
        for ps in probes.values():
            t = threading.Thread(
                target=self._probe_loop, args=(ps,), name=f"gf-probe-{ps.name}", daemon=True
            )
            t.start()
            threads.append(t)
        if self.quality is not None:
            threads.append(self.quality.start(self.done_event))
        t0 = self.phase_at["baseline"]
        self.echo(f"  baseline {exp.baseline:g}s")
        if self._wait(t0 + exp.baseline):
            return
        for ps in probes.values():
            if ps.sot:
                self._sample(ps, "baseline")
        self.before_ok = self._before(probes, load)
        if not self.before_ok:
            self.echo("  steady state not met before the method: nothing armed")
            self._set_phase("after")
            return
        self._set_phase("fault")
        tm = self.phase_at["fault"]
        self.steps = [StepRun(s, tm + s.start) for s in exp.steps]
        self.echo(f"  method {exp.method_window:g}s, {len(self.steps)} step(s)")
        groups: dict[float, list[StepRun]] = {}
        for sr in self.steps:
            groups.setdefault(sr.planned_start, []).append(sr)
        for due in sorted(groups):
            if self._wait(due):
                break
            self._arm(groups[due], facts)
            if self.stop_event.is_set():
                break
        # Until the method window is over and every step has ended by itself.
        end = tm + exp.method_window
        while not self.stop_event.is_set():
            for s in self.steps:
                if s.fault is not None and s.ended_at is None and s.fault.wait(0):
                    self._ended(s)
            if time.time() >= end and not [
                s for s in self.steps if s.fault is not None and s.ended_at is None
            ]:
                break
            self.remedy.check(load, self.phase_at["baseline"])
            self.stop_event.wait(0.1)
        if self.stop_event.is_set():
            return
        # A fault ends at its kernel deadline (armed + duration) or when it
        # was stopped, whichever came first; its controller exits after.
        ends = [
            min(s.ended_at or 0.0, s.fault.started_at + s.step.duration)
            for s in self.steps
            if s.fault is not None
        ]
        fault_end = max(ends) if ends else end
        self.fault_end = fault_end
        self._set_phase("recovery")
        self.echo(f"  recovery {exp.recovery:g}s")
        while not self._wait(min(fault_end + exp.recovery, time.time() + 0.5)):
            self.remedy.check(load, self.phase_at["baseline"])
            if time.time() >= fault_end + exp.recovery:
                break
        if self.stop_event.is_set():
            return
        self._set_phase("after")
        for ps in probes.values():
            if ps.eot:
                self._sample(ps, "after")

    def _arm(self, group: list[StepRun], facts: dict[str, Any]) -> None:
        """Arm the steps due at one moment: each kind launches its step
        (together where it can: LocalFaultHost.launch), then each is awaited."""
        launched = [(sr, kind_of(sr.step).launch(self, sr, facts)) for sr in group]
        for sr, pending in launched:
            s = sr.step
            kind = kind_of(s)
            try:
                f = kind.arm(self, sr, pending, facts)
            except FaultHostError as e:
                if self.stop_event.is_set():  # stopped by the abort while it armed
                    sr.status = "skipped"
                    continue
                sr.status, sr.error = "failed", str(e)
                self.echo(f"  step {s.idx + 1} {s.name}: {e}")
                continue
            finally:
                with self.lock:
                    if pending in self.launching:
                        self.launching.remove(pending)
            with self.lock:
                sr.fault = f
                sr.status = "armed"
                if s.pid or s.tid:  # where its faults went (traffic has neither)
                    who = self.who.get(s.idx)
                    sr.fault_pid, sr.fault_tid = who if who else (None, None)
                # Another node's step: its pid/tid are that node's, not ours to read.
                local = s.agent is None
                sr.thread_name = (thread_name(sr.fault_pid, sr.fault_tid) if local else None) or (
                    s.thread
                )
                aborted = self.stop_event.is_set()
            self._active(+1)
            if aborted:
                f.stop()  # armed while the abort came: stop it at once too
            late = f.started_at - sr.planned_start
            self.echo(
                f"  step {s.idx + 1} {s.name}: {kind.armed_line(f)}, {late:.2f}s after "
                f"its planned start) for {s.duration:g}s"
            )

    def _ended(self, s: StepRun) -> None:
        f = s.fault
        assert f is not None
        row = getattr(f, "run_row", lambda: None)()
        s.ended_at = float(row["ended"]) if row and row.get("ended") else f.ended_at
        s.fires = f.fires()
        self._active(-1)
        if f.rc not in (0, None) and not (self.stop_event.is_set() and f.rc in (-15, 143)):
            s.status = "failed"
            lines = [ln for ln in getattr(f, "lines", []) if ln.strip()]
            s.error = f"controller exit status {f.rc}" + (
                f": {lines[-1].removeprefix('gpufault: ')}" if lines else ""
            )
        elif (
            self.stop_event.is_set()
            and s.ended_at is not None
            and s.ended_at < f.started_at + s.step.duration - 0.05
        ):
            s.status = "stopped"
        else:
            s.status = "done" if s.fires else "not-fired"

    def _stop_faults(self) -> None:
        live = [(s, s.fault) for s in self.steps if s.fault is not None and s.ended_at is None]
        for _s, f in live:
            f.stop()  # all first: they stop together
        for s, f in live:
            if not f.wait(2.0):
                kill = getattr(f, "kill_after_grace", None)
                if kill is not None:
                    kill()
                f.wait(10)
            self._ended(s)
        for s in self.steps:
            if s.status == "planned":
                s.status = "skipped"


def run(
    exp: Experiment,
    db_path: str,
    *,
    host: FaultHost | None = None,
    echo: Callable[[str], None] = print,
    metrics: Any = None,
) -> Outcome:
    """metrics: a pyctl.observe.metrics.Metrics (phase, verdict, faults
    active), or None."""
    return Run(exp, db_path, host=host, echo=echo, metrics=metrics).execute()


__all__ = ["Outcome", "Run", "StepRun", "run"]
