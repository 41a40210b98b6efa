"""Rollbacks and the remediation hook: what the file says to run when the
experiment ends (every [[rollback]] command, always: on success, abort,
Ctrl-C or an error) and when the SLO first breaches ([remediation], once,
in the background). Both are recorded in the evidence."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

from pyctl.experiment import evidence as E
from pyctl.experiment.model import WINDOW_S, Experiment


def rollbacks(exp: Experiment, rec: E.Record, echo: Callable[[str], None]) -> None:
    for rb in exp.rollbacks:
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
        rec.probe_samples.append(
            E.ProbeSample(
                f"rollback:{rb.name}",
                "after",
                t0,
                rc == 0,
                rc,
                f"{detail} in {time.time() - t0:.2f}s",
            )
        )
        echo(f"  {detail}")


class Remedy:
    """The SLO's first breach runs the remediation command once, on a
    thread of its own (the run goes on); join() waits for it at the end."""

    def __init__(self, exp: Experiment, rec: E.Record, echo: Callable[[str], None]) -> None:
        self.exp, self.rec, self.echo = exp, rec, echo
        self.lock = threading.Lock()
        self.breached_at: float | None = None
        self.thread: threading.Thread | None = None

    def breach(self, at: float, what: str, t0: float) -> None:
        """The SLO breached: run the remediation hook once (in the background)."""
        rem = self.exp.remediation
        with self.lock:
            if self.breached_at is not None:
                return
            self.breached_at = at
        if rem is None:
            return
        self.echo(f"  breach at +{at - t0:.1f}s ({what}): remediation {' '.join(rem.command)}")

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
            self.rec.remediations.append(
                E.RemediationRun(" ".join(rem.command), t0, time.time(), rc)
            )

        self.thread = threading.Thread(target=go, name="gf-exp-remedy", daemon=True)
        self.thread.start()

    def check(self, load: Any, t0: float) -> None:
        """Has the last complete load window breached the SLO? (remediation)"""
        if load is None or self.breached_at is not None or self.exp.remediation is None:
            return
        assert self.exp.load is not None
        # lazy: pyctl.experiment.loadgen (queue, +5 modules) only when this runs
        from pyctl.experiment.loadgen import window_stats

        # The window whose answers are all in (its requests timed out or were
        # answered), and the latest one with the answers so far: those still
        # missing are the slow ones, so a breach seen there is a breach.
        now = time.time()
        for end in (now - 0.2, now - self.exp.load.timeout):
            w = window_stats(load.samples(end - WINDOW_S, end), end - WINDOW_S, end)
            ok, why = self.exp.steady.window_ok(w)
            if w.count and not ok:
                self.breach(now, why, t0)
                return

    def join(self) -> None:
        if self.thread is not None:
            rem = self.exp.remediation
            self.thread.join(rem.timeout + 1 if rem else 1)


__all__ = ["Remedy", "rollbacks"]
