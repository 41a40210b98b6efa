"""The verdict's evidence: what the run recorded, judged against the
hypothesis (before, during, after), the expectations (alert fired,
degradation worked, recovered within, linked evidence) and the judge
(pyctl/experiment/blockjudge.py: 1 s blocks of the baseline and the
recovered seconds vs the fault window's; stats.judge per request).

Evaluation is a part of the Run (pyctl/experiment/run.py): it reads the
run's samples, steps and phase times and writes the evidence rows.
"""

from __future__ import annotations

import json
import math
import signal
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from pyctl.experiment import evidence as E
from pyctl.experiment.model import LINKABLE, WINDOW_S
from pyctl.experiment.steps import kind_of
from pyctl.experiment.verdict import Findings, Verdict, decide

if TYPE_CHECKING:
    import threading

    from pyctl.experiment.model import Experiment
    from pyctl.experiment.probe_state import ProbeState
    from pyctl.experiment.steps.base import StepRun
    from pyctl.experiment.target import PidWatch


class Evaluation:
    """The Run's evaluation methods (a mixin: the Run has the state)."""

    # What it reads of the Run (pyctl/experiment/run.py sets them).
    exp: Experiment
    db_path: str
    rec: E.Record
    phase: str
    phase_at: dict[str, float]
    steps: list[StepRun]
    stop_event: threading.Event
    abort_at: float | None
    abort_reason: str | None
    abort_probe: str
    interrupted: str | None
    target_died: str  # set only when the target died during the run
    # (term, phase, value over the phase, ok) of each load hypothesis check:
    # the per-run SLO series of --metrics-addr (run.py sets them at the end).
    slo_values: list[tuple[str, str, float, bool]]
    quality: Any  # a quality.QualityProbe, or None

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
                E.Hypothesis(
                    "before", name, ok, _v(res), _tol(ps.probe), res.detail if res else "no sample"
                )
            )
        if load is not None:
            t0 = self.phase_at["baseline"]
            ok_all &= self._load_hypothesis("before", load, t0, t0 + exp.baseline)
        if self.quality is not None:
            ok_all &= self._quality_before()
        return ok_all

    def _quality_refs(self) -> list[str] | None:
        # lazy: pyctl.experiment.quality (http.client) only for a file with [quality]
        from pyctl.experiment import quality as Q

        t0 = self.phase_at["baseline"]
        q = self.exp.quality
        assert q is not None
        return Q.references(q, self.quality.rounds(t0, t0 + self.exp.baseline))

    def _quality_before(self) -> bool:
        """The baseline's score: it must be above 0, else no drop can be
        measured (references that do not match the service's answers)."""
        # lazy: pyctl.experiment.quality (http.client) only for a file with [quality]
        from pyctl.experiment import quality as Q

        q = self.exp.quality
        assert q is not None
        t0 = self.phase_at["baseline"]
        rounds = self.quality.rounds(t0, t0 + self.exp.baseline)
        refs = self._quality_refs()
        sc = Q.score_rounds(q, rounds, refs) if refs is not None else None
        ok = sc is not None and sc.score > 0
        self.quality_base = sc.score if sc is not None else math.nan
        what = "BLEU-4" if q.metric == "bleu" else "exact match %"
        self.rec.hypotheses.append(
            E.Hypothesis(
                "before",
                f"quality.{q.metric}",
                ok,
                f"{self.quality_base:.1f}",
                "> 0",
                f"{what} of {sc.answers} answers in {sc.rounds} rounds ({sc.errors} failed)"
                if sc is not None
                else "no round of the cases in the baseline",
            )
        )
        self.slo_values.append((f"quality.{q.metric}", "before", self.quality_base, ok))
        return ok

    def _quality_hypothesis(self, phase: str, start: float, end: float) -> tuple[bool, str]:
        """The drop from the baseline's score over the rounds that started
        in [start, end): within the bound? (ok, what for a failure line)."""
        # lazy: pyctl.experiment.quality (http.client) only for a file with [quality]
        from pyctl.experiment import quality as Q

        q = self.exp.quality
        assert q is not None
        rounds = self.quality.rounds(start, end)
        refs = self._quality_refs() or []
        sc = Q.score_rounds(q, rounds, refs) if refs else Q.Scored(math.nan, 0, 0, 0)
        base = getattr(self, "quality_base", math.nan)
        drop = Q.drop_pct(base, sc.score)
        ok = not math.isnan(drop) and q.bound.check(drop)
        rel0 = self.phase_at["baseline"]
        what = "BLEU-4" if q.metric == "bleu" else "exact match"
        detail = (
            f"{what} {sc.score:.1f} vs {base:.1f} in the baseline; {sc.answers} answers in "
            f"{sc.rounds} rounds started in [{start - rel0:.1f}s, {end - rel0:.1f}s)"
            + (f", {sc.errors} failed" if sc.errors else "")
        )
        self.rec.hypotheses.append(
            E.Hypothesis(phase, q.term, ok, f"{drop:.1f}", str(q.bound), detail)
        )
        self.slo_values.append((q.term, phase, drop, ok))
        return ok, f"{q.term} {q.bound} breached: drop {drop:.1f}% ({detail})"

    def _load_hypothesis(self, phase: str, load: Any, start: float, end: float) -> bool:
        """Each bound holds in at least `quorum` of the phase's 1 s windows.
        Why windows and a quorum, not one p99 over the phase: on a shared
        machine one noisy second (another process's burst) decides the p99
        of a whole phase; a fault (a stall on 20 % of calls) shows in every
        window it is armed in. The phase's own p99 is recorded beside."""
        # lazy: pyctl.experiment.loadgen (queue, +5 modules) only when this runs
        from pyctl.experiment.loadgen import window_stats
        from pyctl.experiment.loadgen import windows as mkwin

        st = self.exp.steady
        agg = window_stats(load.samples(start, end), start, end, st.good)
        wins = [
            w
            for w in mkwin(load.samples(start, end), start, end, WINDOW_S, st.good)
            if w.end - w.start >= WINDOW_S / 2
        ]
        rel0 = self.phase_at["baseline"]
        ok_all = True
        for _term, name, b in st.terms():
            vals = [getattr(w, name) for w in wins if w.count]
            good = sum(1 for v in vals if not math.isnan(v) and b.check(v))
            ok = bool(vals) and good >= st.quorum * len(vals)
            ok_all &= ok
            self.slo_values.append((f"load.{name}", phase, float(getattr(agg, name)), ok))
            self.rec.hypotheses.append(
                E.Hypothesis(
                    phase,
                    f"load.{name}",
                    ok,
                    _fmt(name, getattr(agg, name)),
                    str(b),
                    f"{good}/{len(vals)} 1 s windows within (quorum {st.quorum:.0%}); "
                    f"{agg.count} requests due in [{start - rel0:.1f}s, {end - rel0:.1f}s)"
                    + (f"; good = {st.good}" if name == "goodput" and st.good else ""),
                    slo_id=self.exp.slo_id,
                )
            )
        return ok_all

    def _evaluate(self, probes: dict[str, ProbeState], load: Any) -> Verdict:
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
                E.ProbeSample(
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
            bad = [h for h in self.rec.hypotheses if h.phase == "before" and not h.ok]
            what = ", ".join(f"{h.name} {h.value} (want {h.tolerance})" for h in bad[:3])
            f.errors.append(f"steady state not met before the method: {what}")
        # Steps: armed, fired, stopped.
        for s in self.steps:
            st = s.step
            spec: dict[str, Any] = {
                "fault": st.fault,
                "set": st.sets,
                "thread": st.thread,
                **kind_of(st).spec(st),
                **({"pid": s.fault_pid} if s.fault_pid else {}),
                **({"tid": s.fault_tid} if s.fault_tid else {}),
                "specs": [sp.to_json() for sp in st.specs],
                "describe": [sp.describe() for sp in st.specs],
                **({"error": s.error} if s.error else {}),
            }
            checked = kind_of(st).check(s.fault) if s.status in ("done", "stopped") else None
            if checked is not None:
                ok, counts, detail = checked
                spec["answers"], spec["bad_cases"] = counts["answers"], counts["bad_cases"]
                spec["check"] = detail
                if not ok:
                    f.failures.append(f"step {st.idx + 1} ({st.name}): {detail}")
            self.rec.steps.append(
                E.StepRow(
                    idx=st.idx,
                    name=st.name,
                    template=st.template,
                    spec=spec,
                    run_id=s.fault.run_id if s.fault else None,
                    planned_start=s.planned_start,
                    planned_duration=st.duration,
                    started_at=s.fault.started_at if s.fault else None,
                    ended_at=s.ended_at,
                    fires=len(s.fires),
                    status=s.status,
                    thread_name=s.thread_name,
                )
            )
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
                    E.ProbeSample(
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
            # lazy: pyctl.experiment.loadgen (queue, +5 modules) only when this runs
            from pyctl.experiment.loadgen import windows as mkwin

            for w in mkwin(load.samples(t0, end_all), t0, end_all, WINDOW_S, exp.steady.good):
                if w.end - w.start < WINDOW_S / 2:
                    continue  # the stub at the end: too few requests to say anything
                windows.append((w, self._phase_of((w.start + w.end) / 2)))
            self.rec.load_windows = [E.LoadWindow(w, ph) for w, ph in windows]
            if exp.slos:
                self._burn_slos(load, t0, end_all, f)
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
                    E.Hypothesis(
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
                        if h.phase == "during" and not h.ok and h.name.startswith("load.")
                    ]
                    h = bad[0]
                    f.failures.append(
                        f"{h.name} {h.tolerance} breached during the fault window "
                        f"({h.detail.split(';')[0]}; {h.name} {h.value} over the window)"
                    )
                if exp.steady.judge is not None:
                    self._judge(load, t0, fw_start, fw_end, f)
            if self.quality is not None and getattr(self, "quality_base", None) is not None:
                ok, why = self._quality_hypothesis("during", fw_start, fw_end)
                if not ok and not f.abort:
                    f.failures.append(
                        f"{why.replace('breached', 'breached during the fault window', 1)}"
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
                        E.Hypothesis(
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
                if self.quality is not None and getattr(self, "quality_base", None) is not None:
                    a = self.phase_at["after"]
                    hold = exp.expect.recovery_hold
                    ok, why = self._quality_hypothesis("after", a - hold, a)
                    if not ok:
                        f.failures.append(f"{why} in the last {hold:g}s of recovery")
        return decide(f)

    def _judge(self, load: Any, t0: float, fw_start: float, fw_end: float, f: Findings) -> None:
        """The judge's rows: is the fault window's latency worse than the
        baseline's (docs/experiments.md, "Statistics")? The default judge
        (blocks) compares 1 s blocks of the baseline and of the recovered
        seconds after the fault (the after hypothesis's last `hold`, when
        the recovery phase is that long and the run got there) with the
        fault window's; method = "requests" is the per-request judge."""
        # lazy: pyctl.experiment.stats (+1 module) only when this runs
        from pyctl.experiment import stats

        exp = self.exp
        jd = exp.steady.judge
        assert jd is not None
        if jd.method == "blocks":
            # lazy: pyctl.experiment.blockjudge only when this runs
            from pyctl.experiment import blockjudge as BJ

            ref = [(t0, t0 + exp.baseline)]
            a, hold = self.phase_at.get("after"), exp.expect.recovery_hold
            if (
                a is not None
                and self.phase == "after"
                and BJ.after_counts(exp.recovery, hold)
                and not self.stop_event.is_set()
            ):
                ref.append((a - hold, a))
            end = max(z for _a, z in [*ref, (fw_start, fw_end)])
            timed = [(x.due, x.latency) for x in load.samples(t0, end)]
            j = BJ.judge_timed(
                timed, ref, (fw_start, fw_end), alpha=jd.alpha, min_ratio=jd.min_ratio
            )
        else:
            base = [x.latency for x in load.samples(t0, t0 + exp.baseline)]
            win = [x.latency for x in load.samples(fw_start, fw_end)]
            how: dict[str, Any] = {
                "higher_is_worse": True,
                "alpha": jd.alpha,
                "min_effect": jd.min_effect,
                "min_tail_effect": jd.min_tail_effect,
            }
            if jd.control:
                # The baseline as its 1 s windows (the A/A splits' blocks).
                blocks = [
                    [x.latency for x in load.samples(b, b + WINDOW_S)]
                    for b in (t0 + k * WINDOW_S for k in range(int(exp.baseline / WINDOW_S)))
                ]
                ctl = stats.judge_with_control(blocks, win, **how)
                self.rec.judgements.append(E.Judged("latency:a/a", ctl.aa, exp.slo_id))
                j = ctl.window
            else:
                j = stats.judge(base, win, **how)
        self.rec.judgements.append(E.Judged("latency", j, exp.slo_id))
        if j.worse and not f.abort:
            f.failures.append(f"latency worse in the fault window than the baseline: {j.reason}")

    def _burn_slos(self, load: Any, t0: float, end: float, f: Findings) -> None:
        """The [[slo]] burn-rate SLOs over the run's windows: their rows,
        and a firing alert as a failure (in the baseline: an error, since
        the steady state burnt budget before any fault)."""
        # lazy: pyctl.experiment.burn only for a file with [[slo]]
        from pyctl.experiment import burn

        j = burn.evaluate(self.exp.slos, load.samples(t0, end), t0, end, self._phase_of)
        self.rec.slo_windows, self.rec.slo_burns = j.windows, j.burns
        for phase, sid, ok, value, tol, detail, near in j.hypotheses:
            self.rec.hypotheses.append(
                E.Hypothesis(phase, f"slo.{sid}", ok, value, tol, detail, slo_id=sid)
            )
            self.slo_values.append((f"slo.{sid}", phase, near, ok))
        self.slo_burn_peaks = j.peaks
        f.errors.extend(j.errors)
        if not f.abort:
            f.failures.extend(j.failures)

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
        # lazy: pyctl.experiment.stats (+1 module) only when this runs
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
            self.rec.expectations.append(E.Expectation("alert_fired", ok, after, d))
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
            self.rec.expectations.append(E.Expectation("degradation_worked", ok, share, d))
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
                E.Expectation(
                    "recovered_within", ok, rt, d + f" (want <= {ex.recovered_within:g}s)"
                )
            )
            if not ok:
                f.failures.append(f"recovered_within {ex.recovered_within:g}s: {d}")
        for what in ex.linked:
            ok, count, d = self._linked(what)
            self.rec.expectations.append(E.Expectation(f"linked:{what}", ok, count, d))
            if not ok:
                f.failures.append(f"linked {what}: {d}")

    def _linked(self, what: str) -> tuple[bool, float, str]:
        """Whether a row of the evidence table `what` names (links to) one of
        this experiment's fault IDs; the Xid monitor and the anchor reader of
        each step's controller wrote them into the same database."""
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


def _fmt(name: str, v: float) -> str:
    """Latencies in ms, shares and rates as numbers."""
    return f"{v * 1000:.1f}ms" if name.endswith(("p50", "p95", "p99")) else f"{v:.4g}"


def _v(res: Any) -> str:
    return "" if res is None or res.value is None else str(res.value)


def _tol(probe: Any) -> str:
    t = getattr(probe, "tolerance", None)
    return "" if t is None else str(t)


def _detail(r: Any) -> str:
    if r.value is not None and not isinstance(r.value, (int, float)):
        return f"{r.detail} [{r.value}]" if r.detail else str(r.value)
    return r.detail


__all__ = ["Evaluation"]
