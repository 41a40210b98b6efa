"""Run one experiment: baseline -> method -> recovery -> after, rollbacks always.

    baseline   load + probes for `phases.baseline`; start-of-test probes at its end
               (the hypothesis "before": if it does not hold, nothing is armed)
    method     fault steps at their offsets (FaultHost), continuous and onchaos
               probes, abort guards (N failures in a row stop every fault at once)
    recovery   load and probes go on for `phases.recovery` after the last fault ended
    after      end-of-test probes; then the load stops
    rollback   always: on success, on abort, on Ctrl-C/SIGTERM, on an exception

Every check of the target (URL reachable, process running, thread found,
probes buildable) happens before the experiment row is written or a fault
armed. The statistics are computed at the end from what was recorded:
stats.judge on per-request latencies (baseline vs the fault window) and
stats.recovery_time over the 1 s load windows (or a probe's samples).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pyctl.evidence import store
from pyctl.experiment import corpora
from pyctl.experiment import evidence as E
from pyctl.experiment.facts import render_facts
from pyctl.experiment.files import (
    ADMIN_TOKEN_ENV,
    GPUFAULT,
    Experiment,
    ExperimentError,
    Step,
)
from pyctl.experiment.host import (
    EndsOnItsOwn,
    FaultHost,
    FaultHostError,
    LocalFaultHost,
    RunningFault,
    StepRequest,
    child_argv,
    child_env,
)
from pyctl.experiment.metrics_feed import MetricsFeed
from pyctl.experiment.perturb_step import PerturbRun
from pyctl.experiment.pressure_step import PressureRun
from pyctl.experiment.verdict import Findings, Verdict, decide

WINDOW_S = 1.0  # load windows (the SLO's resolution)
PROBE_INTERVAL_S = 0.5  # a probe without its own interval


# ---- the target ----------------------------------------------------------------------------


class TargetProcess:
    """A process gpufault starts (target.command or target.service): ready
    when its ready line appears on stderr (and its ready file, if it was
    given one); stopped with SIGTERM at the end; told to die with us."""

    def __init__(
        self,
        argv: list[str],
        ready: str,
        ready_file: Path | None,
        timeout: float,
        env: dict[str, str] | None = None,
    ) -> None:
        self.ready_re = re.compile(ready)
        self.ready_file = ready_file
        self.admin_token: str | None = None  # a service's /admin token, set by start_target
        self.lines: list[str] = []
        self.match: re.Match[str] | None = None
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            argv,
            env=child_env(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name="gf-exp-target", daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or self.match is None:
            tail = " | ".join(ln for ln in self.lines[-3:] if ln.strip())
            rc = self.proc.poll()
            self.stop()
            why = f"exited with status {rc}" if rc is not None else f"not ready in {timeout:g}s"
            raise ExperimentError(
                f"target: {argv[0]} {why} ({tail or 'no output'}): "
                "check target.command / target.service"
            )

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for ln in self.proc.stderr:
            self.lines.append(ln.rstrip("\n"))
            del self.lines[:-200]
            if self.match is None and (m := self.ready_re.search(ln)):
                self.match = m
                self._ready.set()
        self._ready.set()

    def facts(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pid": self.proc.pid}
        m = self.match
        if m is not None:
            gd = m.groupdict()
            if gd.get("url"):
                out["url"] = gd["url"]
            line = m.string
            if (p := re.search(r"\bpid (\d+)", line)) is not None:
                out["pid"] = int(p.group(1))
            if (t := re.search(r"\btid (\d+)", line)) is not None:
                out["worker_tid"] = int(t.group(1))
            # The service's --ranks N line: "... rank 1 pid P tid T".
            for r, rp, rt in re.findall(r"\brank (\d+) pid (\d+) tid (\d+)", line):
                out[f"rank{r}_pid"], out[f"rank{r}_tid"] = int(rp), int(rt)
        if self.ready_file is not None and self.ready_file.is_file():
            try:
                info = json.loads(self.ready_file.read_text())
            except (OSError, ValueError):
                info = {}
            out.update({k: info[k] for k in ("url", "pid", "worker_tid") if k in info})
            out.update(rank_facts(info))
        return out

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)
            try:
                self.ready_file.parent.rmdir()
            except OSError:
                pass
        return self.proc.returncode


def rank_facts(info: dict[str, Any]) -> dict[str, int]:
    """rankN_pid / rankN_tid from a ready file's `ranks` list (the service's
    --ranks N: [{"rank", "pid", "worker_tid", ...}, ...])."""
    out: dict[str, int] = {}
    ranks = info.get("ranks")
    for r in ranks if isinstance(ranks, list) else []:
        if not isinstance(r, dict) or not isinstance(r.get("rank"), int):
            continue
        for key, fact in (("pid", "pid"), ("worker_tid", "tid")):
            v = r.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out[f"rank{r['rank']}_{fact}"] = v
    return out


def start_target(exp: Experiment) -> tuple[TargetProcess | None, dict[str, Any]]:
    t = exp.target
    facts: dict[str, Any] = {"url": t.url, "pid": t.pid}
    proc = None
    if t.command:
        ready_file = None
        argv = list(t.command)
        if argv[0] == GPUFAULT:
            # This gpufault, isolated. No private ready file for it: its
            # directory would outlive a SIGKILLed runner; its ready line
            # names rank N's pid and tid as well.
            argv = child_argv(argv[1:])
        elif any("{ready_file}" in a for a in argv):
            import tempfile

            ready_file = Path(tempfile.mkdtemp(prefix="gpufault-exp-")) / "ready.json"
            argv = [a.replace("{ready_file}", str(ready_file)) for a in argv]
        env = dict(t.env)
        token = None
        if t.admin_token_env is not None:
            # A fresh admin token for the process it starts: its perturb
            # steps send it; nobody else knows it (the child's environment
            # is readable by its own user only).
            import secrets

            token = secrets.token_urlsafe(32)
            env[t.admin_token_env] = token
        proc = TargetProcess(argv, t.ready, ready_file, t.start_timeout, env or None)
        proc.admin_token = token
        facts.update({k: v for k, v in proc.facts().items() if v is not None})
        if t.url:
            facts["url"] = t.url
    try:
        check_target(exp, facts)
    except BaseException:
        if proc is not None:
            proc.stop()
        raise
    return proc, facts


def check_target(exp: Experiment, facts: dict[str, Any]) -> None:
    """Before anything is armed: the URL answers TCP, the process runs."""
    where = str(exp.path)
    url = facts.get("url")
    if not url:
        raise ExperimentError(
            f"{where}: target.url: unknown (the ready line gave none): set target.url"
        )
    u = urlsplit(str(url))
    host, port = u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as e:
        raise ExperimentError(
            f"{where}: target.url: {url} is unreachable ({e.strerror or e}): "
            "start the service or fix the url"
        ) from None
    facts.update(url=str(url).rstrip("/"), host=host, port=port)
    pid = facts.get("pid")
    from pyctl.engine import EngineError
    from pyctl.runner import check_target_pid

    try:
        check_target_pid(int(pid or 0), "target.pid")
    except EngineError as e:
        raise ExperimentError(f"{where}: target.pid: {e}") from None


def thread_by_name(pid: int, name: str) -> int | None:
    """The thread of pid whose comm is name (gf-worker), lowest tid first."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None
    for tid in tids:
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == name:
                return tid
        except OSError:
            continue
    return None


def _tgid(tid: int) -> int | None:
    """The process a thread id belongs to (/proc/TID/status Tgid)."""
    try:
        for ln in Path(f"/proc/{tid}/status").read_text().splitlines():
            if ln.startswith("Tgid:"):
                return int(ln.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def step_target(exp: Experiment, s: Step, facts: dict[str, Any]) -> tuple[int, int | None]:
    """The process (and thread) a fault step goes into: the target's pid,
    or the step's own `pid` / `tid` (a number or a fact such as
    {rank1_pid}), checked before anything is armed."""
    from pyctl.engine import EngineError
    from pyctl.runner import check_target_pid

    key = f"{exp.path}: method[{s.idx + 1}]"

    def fact(name: str, text: str | None) -> int | None:
        if text is None:
            return None
        m = re.fullmatch(r"\{(\w+)\}", text)
        if m is None:
            return int(text)
        v = facts.get(m.group(1))
        if v is None:
            have = ", ".join(sorted(k for k in facts if k.endswith(("pid", "tid")))) or "none"
            raise ExperimentError(
                f"{key}.{name}: the target has no fact {m.group(1)!r} (it has {have}): "
                "start the target with that rank (--ranks 2) or give a number"
            )
        return int(v)

    tid = fact("tid", s.tid)
    pid = fact("pid", s.pid)
    if tid is not None:
        owner = _tgid(tid)
        if owner is None:
            raise ExperimentError(f"{key}.tid: no thread {tid} is running: fix the tid")
        if pid is not None and owner != pid:
            raise ExperimentError(
                f"{key}.tid: thread {tid} belongs to pid {owner}, not {pid}: fix one"
            )
        pid = owner
    if pid is None:
        pid = int(facts["pid"])
    elif s.pid is not None:
        try:
            check_target_pid(pid, f"method[{s.idx + 1}].pid")
        except EngineError as e:
            raise ExperimentError(f"{key}.pid: {e}") from None
    if s.thread and thread_by_name(pid, s.thread) is None:
        raise ExperimentError(f"{key}.thread: no thread {s.thread!r} in pid {pid}: fix the name")
    return pid, tid


class TrafficRun(EndsOnItsOwn):
    """A traffic step (a second open-loop load for the step's duration)
    behind the RunningFault interface: its requests are its fires."""

    run_id = ""  # no controller, no runs row

    def __init__(self, url: str, step: Step, cases: list[tuple[str, bytes]] | None) -> None:
        from pyctl.experiment.loadgen import OpenLoopLoad

        t = step.traffic
        assert t is not None
        self.traffic = t
        self.names = [n for n, _b in cases] if cases else ["prompt"]
        bodies = [b for _n, b in cases] if cases else None
        self.load = OpenLoopLoad(
            url,
            t.rate,
            prompt=t.prompt,
            max_tokens=t.max_tokens,
            timeout=t.timeout,
            path=t.path,
            concurrency=t.concurrency,
            duration=step.duration,
            bodies=bodies,
        )
        n = len(bodies) if bodies else 1
        self.what = f"sending ({corpora.describe(t)}, {n} bodies at {t.rate:g}/s"
        self._ended_at: float | None = None
        self._done = threading.Event()
        self.started_at = time.time()
        self.load.start()
        self._waiter = threading.Thread(target=self._run, name="gf-exp-traffic", daemon=True)
        self._waiter.start()

    def _run(self) -> None:
        self.load.wait()
        self.load.stop()  # the requests already due are answered or time out
        self._ended_at = time.time()
        self._done.set()

    def stop(self) -> None:
        # Not load.stop() here: it waits for answers, and an abort stops
        # every step at once from the guard's thread.
        self.load.halt()

    def fires(self) -> list[tuple[str, float]]:
        return [(f"request-{x.index}", x.sent) for x in self.load.samples() if x.sent]

    def check(self) -> tuple[bool, dict[str, Any], str]:
        """Every answer within ok_status (up to max_bad of them outside)?"""
        from collections import Counter

        t = self.traffic
        lo, hi = t.ok_status
        got = self.load.samples()
        kinds = Counter(str(x.status) if x.status else x.error for x in got)
        bad = [x for x in got if not lo <= x.status <= hi]
        ok = bool(got) and len(bad) <= t.max_bad * len(got)
        # Which cases got them: the finding a user acts on.
        which = Counter(
            f"{self.names[x.index % len(self.names)]} {x.status or x.error}" for x in bad
        )
        cases = ", ".join(k for k, _v in which.most_common(6))
        more = f" +{len(which) - 6} more" if len(which) > 6 else ""
        detail = (
            f"{len(bad)} of {len(got)} answers outside [{lo}, {hi}] "
            f"({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})"
            + (f"; bad: {cases}{more}" if bad else "")
        )
        return (
            ok,
            {"answers": dict(kinds), "bad": len(bad), "sent": len(got), "bad_cases": sorted(which)},
            detail,
        )


# ---- probes --------------------------------------------------------------------------------


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


# ---- the run -------------------------------------------------------------------------------


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


@dataclass
class Outcome:
    experiment_id: str
    verdict: Verdict
    db_path: str
    started_at: float
    ended_at: float
    abort_at: float | None
    steps: list[StepRun]

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code


class Run:
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
        self.host: FaultHost = host or LocalFaultHost(db_path)
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
        self.remediation_thread: threading.Thread | None = None
        self.breached_at: float | None = None
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
            self._breach(res.at, f"probe {ps.name}: {res.detail}")
        return res

    def _breach(self, at: float, what: str) -> None:
        """The SLO breached: run the remediation hook once (in the background)."""
        rem = self.exp.remediation
        with self.lock:
            if self.breached_at is not None:
                return
            self.breached_at = at
        if rem is None:
            return
        self.echo(
            f"  breach at +{at - self.phase_at['baseline']:.1f}s ({what}): "
            f"remediation {' '.join(rem.command)}"
        )

        def go() -> None:
            t0 = time.time()
            rc: int | None
            try:
                rc = subprocess.run(
                    rem.command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=rem.timeout,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = None
            except OSError:
                rc = 127
            self.rec.remediations.append((" ".join(rem.command), t0, time.time(), rc))

        self.remediation_thread = threading.Thread(target=go, name="gf-exp-remedy", daemon=True)
        self.remediation_thread.start()

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
        faults = [s for s in exp.steps if s.specs]
        if faults and os.geteuid() != 0 and isinstance(self.host, LocalFaultHost):
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
                if s.traffic is not None:
                    n = int(s.traffic.rate * s.duration) + 1
                    self.traffic_bodies[s.idx] = corpora.cases(s.traffic, n)
                    continue
                self.who[s.idx] = step_target(exp, s, facts)
            probes = build_probes(exp, facts, proc.proc if proc is not None else None)
            if exp.load is not None:
                from pyctl.experiment.loadgen import OpenLoopLoad

                L = exp.load
                # Enough distinct bodies for a cold corpus over the whole run.
                span = exp.warmup + exp.baseline + exp.method_window + exp.recovery + 5
                load = OpenLoopLoad(
                    facts["url"],
                    L.rate,
                    prompt=L.prompt,
                    max_tokens=L.max_tokens,
                    timeout=L.timeout,
                    path=L.path,
                    concurrency=L.concurrency,
                    bodies=corpora.bodies(L, int(L.rate * span) + 1),
                )
            xid = ev.start(exp, self.host.name)
            started = time.time()
            self.echo(
                f"experiment {xid}: {exp.ident} against {facts['url']} (pid "
                f"{facts['pid']}) -> {self.db_path}"
            )
            if threading.current_thread() is threading.main_thread():
                old = {
                    n: signal.signal(n, self._interrupt) for n in (signal.SIGINT, signal.SIGTERM)
                }
            failed: Exception | None = None
            feed = None
            if self.metrics is not None:  # the steps' fires, read back from the database
                feed = MetricsFeed(self.db_path, self.metrics, self._step_runs).start()
            try:
                self._phases(facts, probes, load, probe_threads)
            except Exception as e:  # noqa: BLE001 - cleaned up, recorded, raised below
                failed = e
            finally:
                self._stop_faults()
                self.done_event.set()
                if load is not None:
                    load.stop()
                for th in probe_threads:
                    th.join(10)
                self._rollbacks()
                if self.remediation_thread is not None:
                    self.remediation_thread.join(
                        exp.remediation.timeout + 1 if exp.remediation else 1
                    )
                for signum, h in old.items():
                    signal.signal(signum, h)
                if feed is not None:
                    feed.stop()  # a last look: every fire counted before the verdict
            if proc is not None and proc.proc.poll() is not None:
                self.target_died = _died(proc)
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
                self.metrics.set_verdict(verdict.verdict)
            ended = time.time()
            return Outcome(xid, verdict, self.db_path, started, ended, self.abort_at, self.steps)
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
            self._check_breach(load)
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
            self._check_breach(load)
            if time.time() >= fault_end + exp.recovery:
                break
        if self.stop_event.is_set():
            return
        self._set_phase("after")
        for ps in probes.values():
            if ps.eot:
                self._sample(ps, "after")

    def _arm(self, group: list[StepRun], facts: dict[str, Any]) -> None:
        """Arm the steps due at one moment: launched together where the host
        can (LocalFaultHost.launch), then each awaited."""
        launched: list[tuple[StepRun, Any]] = []
        for sr in group:
            s = sr.step
            if s.traffic is not None:
                with self.lock:
                    child = TrafficRun(facts["url"], s, self.traffic_bodies.get(s.idx))
                    self.launching.append(child)
                launched.append((sr, child))
                continue
            if s.perturb is not None or s.pressure is not None:
                launched.append((sr, None))  # armed below: one POST, or its child holding
                continue
            pid, tid = self.who.get(s.idx, (int(facts["pid"]), None))
            if s.thread:
                tid = thread_by_name(pid, s.thread)
            req = StepRequest(
                idx=s.idx,
                name=s.name,
                template=s.template,
                sets=s.sets,
                fault=s.fault,
                specs=s.specs,
                duration=s.duration,
                pid=pid,
                tid=tid,
                arm_timeout=s.arm_timeout,
            )
            launch = getattr(self.host, "launch", None)
            if launch is None:
                launched.append((sr, req))
                continue
            with self.lock:
                child = launch(req)
                self.launching.append(child)  # an abort stops it too, armed or not
            launched.append((sr, child))
        for sr, pending in launched:
            s = sr.step
            try:
                if isinstance(pending, StepRequest):
                    f = self.host.start(pending)
                elif isinstance(pending, TrafficRun):
                    f = pending  # sending from now on: nothing to arm
                elif s.pressure is not None:
                    f = PressureRun(
                        s.pressure,
                        s.duration,
                        self.db_path,
                        s.arm_timeout or float(getattr(self.host, "arm_timeout", 60.0)),
                    )
                elif s.perturb is not None:
                    f = PerturbRun(
                        str(render_facts(s.perturb["url"], facts)),
                        s.perturb["rules"],
                        s.perturb["seed"],
                        s.duration,
                        self.db_path,
                        (facts.get("pid"), facts.get("worker_tid")),
                        token=self.admin_token,
                    )
                else:
                    f = self.host.armed(pending)  # type: ignore[attr-defined]
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
                if not isinstance(pending, TrafficRun) and (s.pid or s.tid):
                    who = self.who.get(s.idx)
                    sr.fault_pid, sr.fault_tid = who if who else (None, None)
                aborted = self.stop_event.is_set()
            self._active(+1)
            if aborted:
                f.stop()  # armed while the abort came: stop it at once too
            late = f.started_at - sr.planned_start
            what = (
                f.what
                if isinstance(f, (TrafficRun, PerturbRun, PressureRun))
                else f"armed (run {f.run_id}"
            )
            self.echo(
                f"  step {s.idx + 1} {s.name}: {what}, {late:.2f}s after "
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

    def _check_breach(self, load: Any) -> None:
        """Has the last complete load window breached the SLO? (remediation)"""
        if load is None or self.breached_at is not None or self.exp.remediation is None:
            return
        assert self.exp.load is not None
        from pyctl.experiment.loadgen import window_stats

        # The window whose answers are all in (its requests timed out or were
        # answered), and the latest one with the answers so far: those still
        # missing are the slow ones, so a breach seen there is a breach.
        now = time.time()
        for end in (now - 0.2, now - self.exp.load.timeout):
            w = window_stats(load.samples(end - WINDOW_S, end), end - WINDOW_S, end)
            ok, why = self.exp.steady.window_ok(w)
            if w.count and not ok:
                self._breach(now, why)
                return

    def _rollbacks(self) -> None:
        for rb in self.exp.rollbacks:
            t0 = time.time()
            try:
                rc = subprocess.run(
                    rb.command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    timeout=rb.timeout,
                ).returncode
                detail = f"rollback {' '.join(rb.command)}: rc {rc}"
            except subprocess.TimeoutExpired:
                rc, detail = -1, f"rollback {' '.join(rb.command)}: timed out"
            except OSError as e:
                rc, detail = 127, f"rollback {' '.join(rb.command)}: {e.strerror}"
            self.rec.probe_samples.append(
                (
                    f"rollback:{rb.name}",
                    "after",
                    t0,
                    rc == 0,
                    rc,
                    f"{detail} in {time.time() - t0:.2f}s",
                )
            )
            self.echo(f"  {detail}")

    # -- evaluation --------------------------------------------------------------------

    def _before(self, probes: dict[str, ProbeState], load: Any) -> bool:
        exp = self.exp
        ok_all = True
        for name in exp.steady.probes:
            ps = probes[name]
            if not ps.sot:
                continue
            res = next((r for ph, r in reversed(ps.samples) if ph == "baseline"), None)
            ok = bool(res is not None and res.ok)
            ok_all &= ok
            self.rec.hypotheses.append(
                ("before", name, ok, _v(res), _tol(ps.probe), res.detail if res else "no sample")
            )
        if load is not None:
            t0 = self.phase_at["baseline"]
            ok_all &= self._load_hypothesis("before", load, t0, t0 + exp.baseline)
        return ok_all

    def _load_hypothesis(self, phase: str, load: Any, start: float, end: float) -> bool:
        """Each bound holds in at least `quorum` of the phase's 1 s windows.
        Why windows and a quorum, not one p99 over the phase: on a shared
        machine one noisy second (another process's burst) decides the p99
        of a whole phase; a fault (a stall on 20 % of calls) shows in every
        window it is armed in. The phase's own p99 is recorded beside."""
        from pyctl.experiment.loadgen import window_stats
        from pyctl.experiment.loadgen import windows as mkwin

        st = self.exp.steady
        agg = window_stats(load.samples(start, end), start, end)
        wins = [
            w
            for w in mkwin(load.samples(start, end), start, end, WINDOW_S)
            if w.end - w.start >= WINDOW_S / 2
        ]
        rel0 = self.phase_at["baseline"]
        ok_all = True
        for name, b in (
            ("p50", st.p50),
            ("p95", st.p95),
            ("p99", st.p99),
            ("error_rate", st.error_rate),
            ("throughput", st.min_throughput),
        ):
            if b is None:
                continue
            vals = [getattr(w, name) for w in wins if w.count]
            good = sum(1 for v in vals if not math.isnan(v) and b.check(v))
            ok = bool(vals) and good >= st.quorum * len(vals)
            ok_all &= ok
            self.rec.hypotheses.append(
                (
                    phase,
                    f"load.{name}",
                    ok,
                    _fmt(name, getattr(agg, name)),
                    str(b),
                    f"{good}/{len(vals)} 1 s windows within (quorum {st.quorum:.0%}); "
                    f"{agg.count} requests due in [{start - rel0:.1f}s, {end - rel0:.1f}s)",
                )
            )
        return ok_all

    def _evaluate(self, probes: dict[str, ProbeState], load: Any) -> Verdict:
        from pyctl.experiment import stats

        exp = self.exp
        f = Findings()
        t0 = self.phase_at["baseline"]
        tm = self.phase_at.get("fault")
        fault_end = getattr(self, "fault_end", None)
        if self.interrupted:
            f.abort = f"interrupted by {self.interrupted}: every fault stopped, rollbacks ran"
        elif self.abort_reason:
            f.abort = f"{self.abort_reason}; every fault stopped"
            # The moment of the abort, in the evidence (docs/experiments.md).
            self.rec.probe_samples.append(
                (
                    f"abort:{self.abort_probe}",
                    "fault",
                    self.abort_at or 0.0,
                    False,
                    None,
                    self.abort_reason,
                )
            )
        if getattr(self, "target_died", None):
            # The first thing a user must hear: every later breach follows from it.
            f.died = self.target_died
        if not getattr(self, "before_ok", True):
            bad = [h for h in self.rec.hypotheses if h[0] == "before" and not h[2]]
            what = ", ".join(f"{h[1]} {h[3]} (want {h[4]})" for h in bad[:3])
            f.errors.append(f"steady state not met before the method: {what}")
        # Steps: armed, fired, stopped.
        for s in self.steps:
            st = s.step
            self.rec.steps.append(
                {
                    "idx": st.idx,
                    "name": st.name,
                    "template": st.template,
                    "spec": {
                        "fault": st.fault,
                        "set": st.sets,
                        "thread": st.thread,
                        **({"traffic": _traffic_json(st)} if st.traffic is not None else {}),
                        **({"perturb": st.perturb} if st.perturb is not None else {}),
                        **({"pressure": st.pressure} if st.pressure is not None else {}),
                        **({"pid": s.fault_pid} if s.fault_pid else {}),
                        **({"tid": s.fault_tid} if s.fault_tid else {}),
                        "specs": [sp.to_json() for sp in st.specs],
                        "describe": [sp.describe() for sp in st.specs],
                        **({"error": s.error} if s.error else {}),
                    },
                    "run_id": s.fault.run_id if s.fault else None,
                    "planned_start": s.planned_start,
                    "planned_duration": st.duration,
                    "started_at": s.fault.started_at if s.fault else None,
                    "ended_at": s.ended_at,
                    "fires": len(s.fires),
                    "status": s.status,
                }
            )
            if isinstance(s.fault, TrafficRun) and s.status in ("done", "stopped"):
                ok, counts, detail = s.fault.check()
                spec = self.rec.steps[-1]["spec"]
                spec["answers"], spec["bad_cases"] = counts["answers"], counts["bad_cases"]
                spec["check"] = detail
                if not ok:
                    f.failures.append(f"step {st.idx + 1} ({st.name}): {detail}")
            if s.status == "failed":
                f.errors.append(f"step {st.idx + 1} ({st.name}) failed: {s.error}")
            elif s.status == "not-fired":
                f.errors.append(
                    f"step {st.idx + 1} ({st.name}) never fired: the fault did not "
                    "happen, so the experiment proves nothing"
                )
        # Samples.
        for ps in probes.values():
            for phase, r in ps.samples:
                self.rec.probe_samples.append(
                    (
                        ps.name,
                        phase,
                        r.at,
                        r.ok,
                        r.value if isinstance(r.value, (int, float)) else None,
                        _detail(r),
                    )
                )
        windows: list[tuple[Any, str]] = []
        end_all = self.phase_at.get("after", time.time())
        if load is not None:
            from pyctl.experiment.loadgen import windows as mkwin

            for w in mkwin(load.samples(t0, end_all), t0, end_all, WINDOW_S):
                if w.end - w.start < WINDOW_S / 2:
                    continue  # the stub at the end: too few requests to say anything
                windows.append((w, self._phase_of((w.start + w.end) / 2)))
            self.rec.load_windows = windows
        # During: continuous / onchaos hypothesis probes, the load over the fault window.
        if tm is not None:
            armed = [s.fault.started_at for s in self.steps if s.fault is not None]
            fw_start = min(armed) if armed else tm
            fw_end = fault_end if fault_end is not None else (self.abort_at or time.time())
            for name in exp.steady.probes:
                ps = probes[name]
                if not (ps.continuous or ps.onchaos):
                    continue
                during = [r for ph, r in ps.samples if ph == "fault"]
                failed = [r for r in during if not r.ok]
                ok = bool(during) and not failed
                why = failed[0].detail if failed else ("" if during else "no sample")
                self.rec.hypotheses.append(
                    (
                        "during",
                        name,
                        ok,
                        f"{len(during) - len(failed)}/{len(during)} ok",
                        _tol(ps.probe),
                        why,
                    )
                )
                if not ok and not f.abort:
                    f.failures.append(f"hypothesis {name} breached during the method: {why}")
            if load is not None:
                if not self._load_hypothesis("during", load, fw_start, fw_end) and not f.abort:
                    bad = [
                        h
                        for h in self.rec.hypotheses
                        if h[0] == "during" and not h[2] and h[1].startswith("load.")
                    ]
                    h = bad[0]
                    f.failures.append(
                        f"{h[1]} {h[4]} breached during the fault window "
                        f"({h[5].split(';')[0]}; {h[1]} {h[3]} over the window)"
                    )
                if exp.steady.judge is not None:
                    base = [x.latency for x in load.samples(t0, t0 + exp.baseline)]
                    win = [x.latency for x in load.samples(fw_start, fw_end)]
                    j = stats.judge(
                        base,
                        win,
                        higher_is_worse=True,
                        alpha=exp.steady.judge.alpha,
                        min_effect=exp.steady.judge.min_effect,
                        min_tail_effect=exp.steady.judge.min_tail_effect,
                    )
                    self.rec.judgements.append(("latency", j))
                    if j.worse and not f.abort:
                        f.failures.append(
                            f"latency worse in the fault window than the baseline: {j.reason}"
                        )
            # Expectations.
            if not f.abort:
                self._expectations(probes, windows, fault_end or fw_end, f)
            # After: end-of-test probes, and the load over the last hold of recovery.
            if self.phase == "after" and not self.stop_event.is_set():
                for name in exp.steady.probes:
                    ps = probes[name]
                    if not ps.eot:
                        continue
                    res = next((r for ph, r in reversed(ps.samples) if ph == "after"), None)
                    ok = bool(res is not None and res.ok)
                    self.rec.hypotheses.append(
                        (
                            "after",
                            name,
                            ok,
                            _v(res),
                            _tol(ps.probe),
                            res.detail if res else "no sample",
                        )
                    )
                    if not ok:
                        f.failures.append(
                            f"hypothesis {name} not met after recovery: "
                            f"{res.detail if res else 'no sample'}"
                        )
                if load is not None:
                    a = self.phase_at["after"]
                    hold = exp.expect.recovery_hold
                    if not self._load_hypothesis("after", load, a - hold, a):
                        f.failures.append(
                            f"load hypothesis not met in the last {hold:g}s of recovery"
                        )
        return decide(f)

    def _pid_died(self, w: PidWatch) -> str:
        """One line on a target given by pid that ended during the run: when
        (relative to the method), and how when a fault step's engine saw
        its exit (an `exit` row of the evidence's links table)."""
        assert w.died_at is not None
        how = self._exit_seen(w.pid)
        at = w.died_at
        tm = self.phase_at.get("fault")
        fault_end = getattr(self, "fault_end", None)
        if tm is not None and at >= tm and (fault_end is None or at <= fault_end):
            when = f"at +{at - tm:.1f}s, during the fault window"
        else:
            t0 = self.phase_at.get("baseline", at)
            when = f"at +{at - t0:.1f}s, in the {self._phase_of(at)} phase"
        return f"the target (pid {w.pid}) died during the experiment ({how}) {when}"

    def _exit_seen(self, pid: int) -> str:
        """ "killed by SIGABRT" / "exit status 3" from the evidence, else why
        it is unknown (only a parent can read the exit status of a process)."""
        import sqlite3

        runs = sorted(
            {s.fault.run_id for s in self.steps if s.fault is not None and s.fault.run_id}
        )
        unknown = "exit status unknown: gpufault did not start it and no fault step traced it"
        if not runs:
            return unknown
        try:
            c = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True)
            try:
                row = c.execute(
                    "SELECT detail FROM links WHERE kind = 'exit' AND pid = ? AND run_id IN "
                    f"({','.join('?' * len(runs))}) ORDER BY ts_ns DESC LIMIT 1",
                    [pid, *runs],
                ).fetchone()
            finally:
                c.close()
        except sqlite3.Error:
            return unknown
        if row is None:
            return unknown
        try:
            d = json.loads(row[0] or "{}")
        except ValueError:
            return unknown
        sig = d.get("term_signal") if isinstance(d, dict) else None
        if isinstance(sig, int) and sig > 0:
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            return f"killed by {name}" + (", core dumped" if d.get("core") else "")
        return f"exit status {d.get('exit_status')}"

    def _phase_of(self, t: float) -> str:
        ph = "baseline"
        for name in ("fault", "recovery", "after"):
            if name in self.phase_at and t >= self.phase_at[name]:
                ph = name
        return ph

    def _expectations(
        self,
        probes: dict[str, ProbeState],
        windows: list[tuple[Any, str]],
        fault_end: float,
        f: Findings,
    ) -> None:
        from pyctl.experiment import stats

        ex = self.exp.expect
        fires = sorted(w for s in self.steps for _fid, w in s.fires)
        if ex.alert_probe is not None:
            ps = probes[ex.alert_probe]
            first = fires[0] if fires else None
            hit = None
            if first is not None:
                hit = next(
                    (
                        r.at
                        for _ph, r in ps.samples
                        if r.ok and first <= r.at <= first + ex.alert_within
                    ),
                    None,
                )
            ok = hit is not None and first is not None
            after = hit - first if hit is not None and first is not None else None
            d = (
                "no fault fired"
                if first is None
                else f"{ex.alert_probe} ok {after:.2f}s after the first fire"
                if after is not None
                else f"{ex.alert_probe} not ok within {ex.alert_within:g}s of the first fire"
            )
            self.rec.expectations.append(("alert_fired", ok, after, d))
            if not ok:
                f.failures.append(f"alert_fired: {d}")
        if ex.degradation_probe is not None:
            ps = probes[ex.degradation_probe]
            during = [r for ph, r in ps.samples if ph == "fault"]
            good = [r for r in during if r.ok]
            ok = bool(good)
            share = len(good) / len(during) if during else None
            d = (
                f"{ex.degradation_probe} ok in {len(good)} of {len(during)} samples during "
                "the method"
            )
            self.rec.expectations.append(("degradation_worked", ok, share, d))
            if not ok:
                f.failures.append(f"degradation_worked: {d}")
        if ex.recovered_within is not None:
            if ex.recovery_probe is not None:
                ps = probes[ex.recovery_probe]
                smp = sorted(r.at for _ph, r in ps.samples)
                oks = {r.at: r.ok for _ph, r in ps.samples}
                wins = (
                    [(a, b, oks[b]) for a, b in zip([smp[0], *smp[:-1]], smp, strict=True)]
                    if smp
                    else []
                )
                what = f"probe {ex.recovery_probe}"
            else:
                wins = [(w.start, w.end, self.exp.steady.window_ok(w)[0]) for w, _ph in windows]
                what = "the load hypothesis per 1 s window"
            rt = stats.recovery_time(wins, fault_end, ex.recovery_hold)
            ok = rt is not None and rt <= ex.recovered_within
            d = (
                f"{what} held for {ex.recovery_hold:g}s from {rt:.2f}s after the faults ended"
                if rt is not None
                else f"{what} never held for {ex.recovery_hold:g}s after the faults ended"
            )
            self.rec.expectations.append(
                ("recovered_within", ok, rt, d + f" (want <= {ex.recovered_within:g}s)")
            )
            if not ok:
                f.failures.append(f"recovered_within {ex.recovered_within:g}s: {d}")
        for what in ex.linked:
            ok, count, d = self._linked(what)
            self.rec.expectations.append((f"linked:{what}", ok, count, d))
            if not ok:
                f.failures.append(f"linked {what}: {d}")

    def _linked(self, what: str) -> tuple[bool, float, str]:
        """Whether a row of the evidence table `what` names (links to) one of
        this experiment's fault IDs; the Xid monitor and the anchor reader of
        each step's controller wrote them into the same database."""
        import sqlite3

        from pyctl.experiment.files import LINKABLE

        table = LINKABLE[what]
        fids = sorted({fid for s in self.steps for fid, _w in s.fires if fid})
        if not fids:
            return False, 0.0, "no fault fired, so nothing can be linked"
        runs = sorted(
            {s.fault.run_id for s in self.steps if s.fault is not None and s.fault.run_id}
        )
        lo, hi = int(self.phase_at["baseline"] * 1e9), time.time_ns()
        # Rows of the window that name no fault of ours (another process's
        # Xid, an anchor of the module's own): said, not counted.
        near = (
            (f"run_id IN ({','.join('?' * len(runs))})", runs)
            if table == "xids"
            else ("wall_ns BETWEEN ? AND ?", [lo, hi])
        )
        try:
            c = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True)
            try:
                marks = ",".join("?" * len(fids))
                (linked,) = c.execute(
                    f"SELECT count(*) FROM {table} WHERE fault_id IN ({marks})", fids
                ).fetchone()
                (seen,) = c.execute(
                    f"SELECT count(*) FROM {table} WHERE {near[0]}", near[1]
                ).fetchone()
            finally:
                c.close()
        except sqlite3.Error as e:
            return False, 0.0, f"the {table} table could not be read ({e})"
        d = (
            f"{linked} {table} row(s) name a fault of this experiment ({len(fids)} fault IDs)"
            if linked
            else f"no {table} row names one of its {len(fids)} fault IDs"
            + (f" ({seen} unlinked row(s) in the window)" if seen else " (none recorded)")
        )
        return bool(linked), float(linked), d


class PidWatch:
    """When a process gpufault did not start ends: a thread waits on its
    pidfd (readable once it has exited; a later process that reuses the
    pid is another pidfd's) and notes the time."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.died_at: float | None = None
        self._stop = threading.Event()
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd, self.died_at = None, time.time()
            return
        self._thread = threading.Thread(target=self._run, name="gf-pidwatch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import select

        assert self._fd is not None
        while not self._stop.is_set():
            # A timeout, not a wake-up pipe: stop() is once per experiment.
            if select.select([self._fd], [], [], 0.2)[0]:
                self.died_at = time.time()
                return

    def stop(self) -> None:
        if self._fd is None:
            return
        import select

        self._stop.set()
        self._thread.join(2)
        if not self._thread.is_alive():
            if self.died_at is None and select.select([self._fd], [], [], 0)[0]:
                self.died_at = time.time()  # between the thread's last look and now
            os.close(self._fd)
            self._fd = None


def _died(proc: TargetProcess) -> str:
    """One line on a target that ended on its own: how, and its last words."""
    rc = proc.proc.returncode
    how = (
        f"killed by {signal.Signals(-rc).name}"
        if rc is not None and rc < 0 and -rc in signal.valid_signals()
        else f"exit status {rc}"
    )
    proc._reader.join(2)  # its last lines
    lines = [ln.strip() for ln in proc.lines if ln.strip()]
    # A C++ abort ends in a backtrace ("frame #37: ..."): the line that
    # says why comes before it (terminate called ..., what(): ...).
    why = [ln for ln in lines if _WHY.search(ln) and not ln.startswith("frame #")]
    tail = " | ".join(why[-2:] if why else lines[-3:])[-400:]
    return f"the target died during the experiment ({how})" + (
        f"; its last words: {tail}" if tail else ""
    )


_WHY = re.compile(r"terminate called|what\(\)|Error|error:|Traceback|Fatal|Aborted|Segmentation")


def _traffic_json(st: Step) -> dict[str, Any]:
    from dataclasses import asdict

    assert st.traffic is not None
    d = asdict(st.traffic)
    d["ok_status"] = list(st.traffic.ok_status)
    return d


def _fmt(name: str, v: float) -> str:
    """Latencies in ms, shares and rates as numbers."""
    return f"{v * 1000:.1f}ms" if name.split(".")[-1] in ("p50", "p95", "p99") else f"{v:.4g}"


def _v(res: Any) -> str:
    return "" if res is None or res.value is None else str(res.value)


def _tol(probe: Any) -> str:
    t = getattr(probe, "tolerance", None)
    return "" if t is None else str(t)


def _detail(r: Any) -> str:
    if r.value is not None and not isinstance(r.value, (int, float)):
        return f"{r.detail} [{r.value}]" if r.detail else str(r.value)
    return r.detail


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


__all__ = [
    "run",
    "Run",
    "Outcome",
    "start_target",
    "check_target",
    "thread_by_name",
    "step_target",
    "rank_facts",
    "TrafficRun",
]
