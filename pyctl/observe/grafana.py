"""Grafana annotations for an experiment's fault steps.

Each fault step becomes one region annotation (its start and end) through
Grafana's HTTP API, `POST /api/annotations` with a JSON body::

    {"time": <start, epoch ms>, "timeEnd": <end, epoch ms>,
     "tags": ["gpufault", "experiment:<name>", "slo_id:<id>", "step:<name>", ...],
     "text": "...", "dashboardUID": "...", "panelId": N}   # the last two optional

and `Authorization: Bearer <token>` (a service account token); Grafana
answers `{"message": "Annotation added", "id": N}`. Without a dashboard the
annotation is an organization one, shown on any dashboard whose annotation
query filters by these tags. The same annotations are always written to a
JSON file too, so a run without Grafana still has them.

This follows Grafana's documented (legacy, still served) annotations API; it
was tested against a local stand-in server that checks the request, never
against a live Grafana (docs/observability.md).
"""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from pyctl.observe import ObserveError


def _rows(db: Any, sql: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
    conn = db.conn if hasattr(db, "conn") else db
    cur = conn.execute(sql, params)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def _ms(t: float) -> int:
    return int(round(t * 1000))


def step_annotation(
    exp: dict[str, Any],
    step: dict[str, Any],
    *,
    fires: int | None = None,
    dashboard_uid: str | None = None,
    panel_id: int | None = None,
) -> dict[str, Any] | None:
    """The annotation of one step (rows of experiments / experiment_steps);
    None for a step that never started. A step still running (no end yet)
    is a point annotation at its start."""
    start = step.get("started_at")
    if start is None:
        return None
    end = step.get("ended_at")
    name = exp.get("name") or exp.get("id") or "?"
    slo = exp.get("slo_id") or ""
    what = step.get("template") or _spec_text(step.get("spec"))
    n = step.get("fires") if fires is None else fires
    tags = [
        "gpufault",
        f"experiment:{name}",
        f"experiment_id:{exp.get('id')}",
        f"slo_id:{slo}",
        f"step:{step.get('name') or step.get('idx')}",
    ]
    if step.get("run_id"):
        tags.append(f"run:{step['run_id']}")
    text = (
        f"gpufault {name} step {step.get('name') or step.get('idx')}: {what}"
        f" ({n if n is not None else '?'} fires, status {step.get('status') or '?'})"
    )
    a: dict[str, Any] = {"time": _ms(float(start)), "tags": tags, "text": text}
    if end is not None:
        a["timeEnd"] = _ms(float(end))
    if dashboard_uid:
        a["dashboardUID"] = dashboard_uid
        if panel_id is not None:
            a["panelId"] = int(panel_id)
    return a


def _spec_text(spec: Any) -> str:
    if not spec:
        return "inline fault"
    try:
        d = json.loads(spec) if isinstance(spec, str) else spec
    except ValueError:
        return str(spec)[:80]
    if isinstance(d, dict) and d.get("describe"):  # the experiment runner's spec
        return "; ".join(str(x) for x in d["describe"])
    if isinstance(d, dict):
        f: dict[str, Any] = d["fault"] if isinstance(d.get("fault"), dict) else d
        keys = ("lib", "fn", "action", "ret", "stall")
        parts = [f"{k}={f[k]}" for k in keys if f.get(k) not in (None, "")]
        return " ".join(parts) or "inline fault"
    return str(d)[:80]


def annotations_for(
    db: Any, experiment_id: str, *, dashboard_uid: str | None = None, panel_id: int | None = None
) -> list[dict[str, Any]]:
    """One annotation per started step of the experiment, in step order."""
    exps = _rows(db, "SELECT * FROM experiments WHERE id = ?", (experiment_id,))
    if not exps:
        raise ObserveError(
            f"experiment {experiment_id}: not in this database; "
            "`gpufault experiment list` shows the recorded ones"
        )
    steps = _rows(
        db, "SELECT * FROM experiment_steps WHERE experiment_id = ? ORDER BY idx", (experiment_id,)
    )
    out = []
    for st in steps:
        a = step_annotation(exps[0], st, dashboard_uid=dashboard_uid, panel_id=panel_id)
        if a is not None:
            out.append(a)
    return out


def write_json(path: str | os.PathLike[str], annotations: list[dict[str, Any]]) -> None:
    """Written whole and renamed into place (a reader never sees half)."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(annotations, indent=2) + "\n")
    os.replace(tmp, p)


def post(grafana_url: str, token: str, annotation: dict[str, Any], timeout: float = 10.0) -> int:
    """POST one annotation; its Grafana id. ObserveError: one line."""
    url = grafana_url.rstrip("/") + "/api/annotations"
    req = urllib.request.Request(
        url,
        data=json.dumps(annotation).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Authorization": f"Bearer {token}",
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            doc = json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read()).get("message") or e.reason
        except (ValueError, OSError):
            why = e.reason
        hint = (
            "; check the token (a service account token with annotations:write)"
            if e.code in (401, 403)
            else ""
        )
        raise ObserveError(f"Grafana {url}: HTTP {e.code}: {why}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ObserveError(
            f"Grafana {url}: {getattr(e, 'reason', e)}; check the Grafana URL"
        ) from None
    ident = doc.get("id")
    if not isinstance(ident, int):
        raise ObserveError(f"Grafana {url}: answered {doc!r}, not an annotation id")
    return ident


def publish(
    db: Any,
    experiment_id: str,
    json_path: str | os.PathLike[str] | None,
    *,
    grafana_url: str | None = None,
    token: str | None = None,
    dashboard_uid: str | None = None,
    panel_id: int | None = None,
    timeout: float = 10.0,
) -> list[dict[str, Any]]:
    """Write the experiment's annotations to json_path (None: no file) and,
    with a URL and a token, post each to Grafana (each entry then carries the `grafana_id` it
    got; the file is rewritten with them)."""
    if grafana_url and not token:
        raise ObserveError(
            "a Grafana URL needs a token (a service account token with annotations:write)"
        )
    try:
        anns = annotations_for(db, experiment_id, dashboard_uid=dashboard_uid, panel_id=panel_id)
    except sqlite3.OperationalError as e:
        raise ObserveError(f"{e}: this database holds no experiments") from None
    if json_path is not None:
        write_json(json_path, anns)
    if grafana_url and token:
        for a in anns:
            a["grafana_id"] = post(
                grafana_url, token, {k: v for k, v in a.items() if k != "grafana_id"}, timeout
            )
        if json_path is not None:
            write_json(json_path, anns)
    return anns
