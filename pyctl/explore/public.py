"""Fault-space exploration from Python (`gpufault.explore`, `gpufault
explore ...`): discover, plan, inject, report, and resume."""

from __future__ import annotations

import fnmatch
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyctl.api.errors import BadInput
from pyctl.api.values import parse_duration
from pyctl.explore import discover as D
from pyctl.explore import inject as I
from pyctl.explore import plan as P
from pyctl.explore import store as S
from pyctl.explore.report import coverage
from pyctl.report.exploremap import short_function


@dataclass(frozen=True)
class Exploration:
    """What an exploration found and how each trial ended."""

    exploration_id: str
    db: str
    status: str  # done, paused, interrupted, target gone, target unhealthy
    points: list[dict[str, Any]]
    trials: list[dict[str, Any]]
    coverage: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def outcome_of(self, site_glob: str) -> list[str]:
        """The outcomes of the trials whose site matches (fnmatch)."""
        by = {p["point"]: p for p in self.points}
        return [
            t["outcome"]
            for t in self.trials
            if fnmatch.fnmatchcase(by.get(t["point"], {}).get("site", ""), site_glob)
        ]


def _phases_s(doc: dict[str, Any]) -> float:
    """The file's warmup and baseline, s (the loader's defaults, 1 s and 5 s,
    where it has none; a knob's placeholder counts as the default)."""
    ph = doc.get("phases") or {}
    total = 0.0
    for key, default in (("warmup", 1.0), ("baseline", 5.0)):
        try:
            total += parse_duration(str(ph[key]), key) if key in ph else default
        except ValueError:
            total += default
    return total


def _workdir(db: str, xid: str, workdir: str | os.PathLike[str] | None) -> Path:
    base = Path(workdir) if workdir else Path(str(db) + ".explore")
    w = base / xid
    w.mkdir(parents=True, exist_ok=True, mode=0o700)
    return w


def _read(db: str, xid: str) -> dict[str, Any]:
    if not Path(db).exists():
        raise BadInput(f"{db}: no such database: give the --db of the exploration")
    with S.ExploreStore(db) as st:
        doc = S.load(st.conn, xid)
    if doc is None:
        raise BadInput(f"exploration {xid}: not in {db}: list them with `gpufault explore report`")
    doc["db"] = db
    return doc


def explore(
    file: str | os.PathLike[str],
    *,
    db: str | os.PathLike[str],
    libs: dict[str, str] | None = None,
    discover_s: float = 4.0,
    window_s: float = 2.0,
    cut: int = 3,
    stall: str = "200ms",
    hang: bool = True,
    pins: str | os.PathLike[str] | None = None,
    max_runs: int | None = None,
    budget_s: float | None = None,
    recover: str = "2s",
    hold: str = "1s",
    workdir: str | os.PathLike[str] | None = None,
    echo: Callable[[str], None] | None = None,
    stop_after: int | None = None,
    target: dict[str, Any] | None = None,
    experiment_echo: Callable[[str], None] | None = None,
) -> Exploration:
    """Discover the fault points of the file's target under its load,
    plan, and run a trial per (site, fault); the store keeps progress
    (stop_after: run at most that many trials now, status `paused`;
    resume() runs the rest). target: a [target] table that replaces the
    file's ({"pid": PID, "url": URL}: a server already running; every
    trial then checks it is alive first)."""
    db = str(db)
    doc = D.with_target(D.read_doc(file), target)
    if "target" not in doc:
        raise BadInput(f"{file}: no [target]: explore needs the service to run and trace")
    filters = P.read_filters(pins)
    xid = S.new_id()
    settings = {
        "libs": libs or D.DEFAULT_LIBS,
        "target": target,
        "discover_s": discover_s,
        "window_s": window_s,
        "cut": cut,
        "stall": stall,
        "hang": hang,
        "recover": recover,
        "hold": hold,
        "max_runs": max_runs,
        "budget_s": budget_s,
        "filters": filters.__dict__,
    }
    say = echo or (lambda _s: None)
    base = Path(workdir) if workdir else Path(db + ".explore")
    had_base = base.exists()
    wd = _workdir(db, xid, workdir)
    started = time.time()
    try:
        disc = D.discover(
            file,
            db=db,
            libs=libs,
            window_s=discover_s,
            cut=cut,
            stall=stall,
            hang=hang,
            workdir=wd,
            target=target,
            on_loaded=lambda: say(
                f"exploration {xid}: discovering fault points of {file} for {discover_s:g}s"
            ),
        )
    except BadInput:
        # Refused before anything ran (the experiment layer writes no row
        # then): leave nothing behind, the database included.
        shutil.rmtree(base if not had_base else wd, ignore_errors=True)
        raise
    except BaseException:
        with S.ExploreStore(db) as st:
            st.start(xid, str(file), repr(doc.get("target")), settings, started)
            st.finish(xid, "failed")
        raise
    with S.ExploreStore(db) as st:
        st.start(xid, str(file), repr(doc.get("target")), settings, started)
    # a trial: warmup and baseline (the file's), the window, recovery and hold, start-up
    per_trial = (
        _phases_s(doc)
        + window_s
        + parse_duration(recover, "recover")
        + parse_duration(hold, "hold")
        + 5.0
    )
    trials, notes = P.make_plan(disc.points, filters, max_runs, budget_s, per_trial)
    notes = [f"{k}: not probed ({v})" for k, v in disc.skipped.items()] + notes
    with S.ExploreStore(db) as st:
        st.discovered(xid, disc.experiment_id, disc.points, disc.calls, trials)
    say(
        f"exploration {xid}: {len(disc.points)} point(s), {disc.sampled} sampled call(s) "
        f"in {disc.window_s:.1f}s; {len(trials)} trial(s) planned"
    )
    return resume(
        xid,
        db=db,
        workdir=workdir,
        echo=echo,
        notes=notes,
        stop_after=stop_after,
        experiment_echo=experiment_echo,
    )


def resume(
    xid: str,
    *,
    db: str | os.PathLike[str],
    workdir: str | os.PathLike[str] | None = None,
    echo: Callable[[str], None] | None = None,
    notes: list[str] | None = None,
    stop_after: int | None = None,
    experiment_echo: Callable[[str], None] | None = None,
) -> Exploration:
    """Run the trials of exploration xid that have no row yet, in plan
    order (stop_after: at most that many now; experiment_echo: gets each
    trial's experiment lines, as `experiment run` prints them)."""
    db = str(db)
    doc = _read(db, xid)
    ex = doc["exploration"]
    xid = ex["id"]
    s = ex["settings"]
    file_doc = D.with_target(D.read_doc(ex["file"]), s.get("target"))
    done = {t["idx"] for t in doc["trials"]}
    wd = _workdir(db, xid, workdir)
    say = echo or (lambda _s: None)
    status = "done"
    pid = I.target_pid(file_doc)
    ran = 0
    for tj in doc["plan"]:
        t = P.Trial(**{**tj, "covers": tuple(tj["covers"])})
        if t.idx in done:
            continue
        if stop_after is not None and ran >= stop_after:
            status = "paused"
            break
        if pid is not None and not I.alive(pid):
            status = "target gone"
            say(
                f"exploration {xid}: the target (pid {pid}) is gone: stopping; "
                f"restart it and `gpufault explore resume {xid}`"
            )
            break
        url = I.target_url(file_doc)
        why = I.answers(url) if pid is not None and url else None
        if why is not None:
            status = "target unhealthy"
            say(
                f"exploration {xid}: the target (pid {pid}) does not answer ({why}): "
                f"stopping; `gpufault explore resume {xid}` once it does"
            )
            break
        say(f"trial {t.idx}: {t.label} in {short_function(t.function)} from {t.site}")
        try:
            row = I.run_trial(
                file_doc,
                t,
                db=db,
                workdir=wd,
                window_s=s["window_s"],
                recover=s["recover"],
                hold=s["hold"],
                echo=experiment_echo,
            )
        except (KeyboardInterrupt, I.TrialInterrupted):
            status = "interrupted"
            say(
                f"exploration {xid}: interrupted in trial {t.idx} (not recorded): "
                f"`gpufault explore resume {xid}` runs it again"
            )
            break
        with S.ExploreStore(db) as st:
            st.trial_done(xid, t, row)
        ran += 1
        say(f"trial {t.idx}: {row['outcome']} ({row['reason'][:100]})")
    with S.ExploreStore(db) as st:
        st.finish(xid, status)
    final = _read(db, xid)
    return Exploration(
        xid, db, status, final["points"], final["trials"], coverage(final), notes or []
    )


def plan_of(db: str | os.PathLike[str], xid: str) -> dict[str, Any]:
    """The stored exploration document (row, points, plan, trials)."""
    return _read(str(db), xid)
