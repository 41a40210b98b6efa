"""Inject: one short experiment per trial, failing only the calls made
from the trial's caller site, judged by the file's steady-state
hypothesis, with a recovery check.

Each trial is an experiment file of its own, written beside the others
(`<workdir>/NN-<point>-<fault>.toml`): the exact spec, and the reproduce
command is `gpufault experiment run FILE --db DB`. The target is the
file's [target]: one gpufault starts (a command, the reference service)
is started fresh by every trial, so a trial that left it broken never
leaks into the next; one given by pid is checked alive before each trial,
and the exploration stops (status `target gone`) when it is not.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Any

from pyctl.api.errors import GpufaultError
from pyctl.evidence import store
from pyctl.experiment.public import load_experiment, run_experiment
from pyctl.explore import outcome as O
from pyctl.explore import tomlout
from pyctl.explore.discover import base_doc
from pyctl.explore.plan import Trial
from pyctl.report.exploremap import short_function


class TrialInterrupted(Exception):
    """SIGINT or SIGTERM ended a trial's experiment: it proves nothing, so
    no row is written and `resume` runs it again."""


def _ret(code: str) -> int | str:
    return int(code) if re.fullmatch(r"-?\d+", code) else code


def trial_doc(
    doc: dict[str, Any], t: Trial, window_s: float, recover: str, hold: str
) -> dict[str, Any]:
    d = base_doc(doc)
    d["name"] = f"explore-{t.point}-{t.idx}"
    d["title"] = f"explore: {t.label} in {short_function(t.function)} from {t.site}"
    fault: dict[str, Any] = {
        "lib": t.library,
        "fn": t.function,
        "action": t.action,
        "caller": t.site,
    }
    if t.action == "fail":
        fault["ret"] = _ret(t.code)
    elif t.code != "hang":
        fault["stall"] = t.code
    d["method"] = [{"name": t.label, "fault": fault, "start": "0s", "duration": f"{window_s:g}s"}]
    d["expect"] = {"recovered_within": {"within": recover, "hold": hold}}
    phases = dict(d.get("phases") or {})
    phases.pop("method", None)
    phases.pop("recovery", None)  # the loader's default: recovered_within + hold
    phases.setdefault("warmup", "1s")  # short trials (discover.py says why)
    d["phases"] = phases
    return d


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def answers(url: str, timeout: float = 5.0) -> str | None:
    """None when url's host:port accepts a TCP connection within timeout;
    else why not (a target given by pid is checked so between trials)."""
    u = urllib.parse.urlsplit(url)
    if not u.hostname:
        return f"{url}: no host"
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((u.hostname, port), timeout=timeout):
            return None
    except OSError as e:
        return f"{u.hostname}:{port}: {e.strerror or e}"


def target_url(doc: dict[str, Any]) -> str | None:
    t = doc.get("target") or {}
    url = t.get("url")
    return url if isinstance(url, str) and "{" not in url else None


def target_pid(doc: dict[str, Any]) -> int | None:
    t = doc.get("target") or {}
    pid = t.get("pid")
    return int(pid) if isinstance(pid, int) else None


def run_trial(
    doc: dict[str, Any],
    t: Trial,
    *,
    db: str,
    workdir: Path,
    window_s: float,
    recover: str,
    hold: str,
    echo: Any = None,
) -> dict[str, Any]:
    """Run one trial; its trial row (status, outcome, reason, ids, times)."""
    name = re.sub(r"[^a-z0-9]+", "-", t.label.lower()).strip("-")[:40]
    path = workdir / f"{t.idx:03d}-{t.point}-{name}.toml"
    d = trial_doc(doc, t, window_s, recover, hold)
    path.write_text(
        tomlout.dumps(
            d,
            f"gpufault explore trial {t.idx}: {t.label} in {t.function}, only calls from "
            f"{t.site}\nreproduce: gpufault experiment run {path} --db {db}",
        )
    )
    row: dict[str, Any] = {
        "file": str(path),
        "started_at": time.time(),
        "reproduce": f"gpufault experiment run {shlex.quote(str(path))} --db {shlex.quote(db)}",
    }
    try:
        v = run_experiment(load_experiment(path), db=db, echo=echo, raise_on_error=False)
    except GpufaultError as e:
        row.update(status="error", outcome="error", reason=str(e), ended_at=time.time())
        return row
    if v.verdict == "aborted" and v.reason.startswith("interrupted by"):
        raise TrialInterrupted(v.reason)
    ev = store.open_db(db)  # after the experiment closed its own connection
    try:
        j = O.classify(v.verdict, v.reason, ev.conn, v.experiment_id)
    finally:
        ev.close()
    row.update(
        status=v.verdict,
        outcome=j.outcome,
        reason=j.reason,
        experiment_id=v.experiment_id,
        fires=j.fires,
        recover_s=j.recover_s,
        ended_at=time.time(),
    )
    return row
