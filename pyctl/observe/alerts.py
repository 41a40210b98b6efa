"""Alert state read back from Prometheus' HTTP API, for an experiment's
`alert_fired` expectation, and the PromQL helpers its query probe uses.

- alert_state(url, "GfServiceP99High", {"slo_id": "chat"}) -> inactive | pending | firing,
  from GET /api/v1/alerts (what the rule manager holds now).
- wait_first_firing(...) polls that until firing or a deadline (the run is
  waiting for an outside event: Prometheus evaluating its rule).
- first_firing(url, name, labels, start, end) looks back instead: the first
  sample of ALERTS{alertname=..., alertstate="firing"} in [start, end]
  (Prometheus writes that series at every rule evaluation), so a check
  after the experiment needs no polling during it.

Only the standard library: urllib, json.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pyctl.observe import ObserveError

STATES = ("inactive", "pending", "firing")


def _get(
    prom_url: str, path: str, params: dict[str, Any] | None = None, timeout: float = 5.0
) -> Any:
    url = prom_url.rstrip("/") + path
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read()).get("error") or e.reason
        except (ValueError, OSError):
            why = e.reason
        raise ObserveError(f"Prometheus {url}: HTTP {e.code}: {why}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ObserveError(
            f"Prometheus {prom_url}: {reason}; is it running, and is that its URL?"
        ) from None
    if doc.get("status") != "success":
        raise ObserveError(f"Prometheus {url}: {doc.get('error') or doc}")
    return doc["data"]


def _matches(alert_labels: dict[str, str], alertname: str, labels: dict[str, str]) -> bool:
    return alert_labels.get("alertname") == alertname and all(
        alert_labels.get(k) == v for k, v in labels.items()
    )


def alerts(
    prom_url: str, alertname: str, labels: dict[str, str] | None = None, timeout: float = 5.0
) -> list[dict[str, Any]]:
    """The pending and firing alerts of that name whose labels include labels."""
    data = _get(prom_url, "/api/v1/alerts", timeout=timeout)
    return [
        a for a in data.get("alerts", []) if _matches(a.get("labels", {}), alertname, labels or {})
    ]


def alert_state(
    prom_url: str, alertname: str, labels: dict[str, str] | None = None, timeout: float = 5.0
) -> str:
    """'firing' if any matching alert fires, else 'pending' if any is pending,
    else 'inactive' (Prometheus lists no inactive alerts)."""
    states = {a.get("state") for a in alerts(prom_url, alertname, labels, timeout)}
    for s in ("firing", "pending"):
        if s in states:
            return s
    return "inactive"


@dataclass(frozen=True)
class Firing:
    """When an alert was first seen firing, and since when it was active
    (pending), per Prometheus' activeAt; both Unix seconds."""

    seen_at: float
    active_at: float | None
    labels: dict[str, str]


def _parse_rfc3339(s: str | None) -> float | None:
    if not s:
        return None

    # Prometheus writes nanoseconds ('...T10:01:02.123456789Z'): datetime takes
    # microseconds at most.
    head, _, frac = s.rstrip("Z").partition(".")
    frac = (frac[:6] if frac else "0").ljust(6, "0")
    try:
        dt = datetime.fromisoformat(f"{head}.{frac}+00:00")
    except ValueError:
        return None
    return dt.timestamp()


def wait_first_firing(
    prom_url: str,
    alertname: str,
    labels: dict[str, str] | None = None,
    *,
    timeout: float,
    every: float = 0.25,
    states_seen: list[str] | None = None,
) -> Firing | None:
    """Poll until a matching alert fires (Firing) or timeout (None).
    states_seen, if given, collects each state change observed (so a test
    can check pending came before firing)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        found = alerts(prom_url, alertname, labels)
        state = "inactive"
        for s in ("firing", "pending"):
            if any(a.get("state") == s for a in found):
                state = s
                break
        if states_seen is not None and state != last:
            states_seen.append(state)
        last = state
        if state == "firing":
            a = next(a for a in found if a.get("state") == "firing")
            return Firing(time.time(), _parse_rfc3339(a.get("activeAt")), a.get("labels", {}))
        if time.monotonic() >= deadline:
            return None
        time.sleep(every)  # Prometheus evaluates rules on its own clock


def _selector(alertname: str, labels: dict[str, str], state: str) -> str:
    def q(v: str) -> str:
        return json.dumps(v)  # PromQL strings take JSON's escapes

    parts = [f"alertname={q(alertname)}", f"alertstate={q(state)}"]
    parts += [f"{k}={q(v)}" for k, v in sorted(labels.items())]
    return "ALERTS{" + ", ".join(parts) + "}"


def query(
    prom_url: str, promql: str, at: float | None = None, timeout: float = 5.0
) -> list[tuple[dict[str, str], float]]:
    """An instant query: [(labels, value)] of a vector (a scalar: one entry
    with no labels)."""
    params: dict[str, Any] = {"query": promql}
    if at is not None:
        params["time"] = f"{at:.3f}"
    data = _get(prom_url, "/api/v1/query", params, timeout)
    if data["resultType"] == "scalar":
        return [({}, float(data["result"][1]))]
    if data["resultType"] != "vector":
        raise ObserveError(f"PromQL {promql!r}: a {data['resultType']}, not an instant vector")
    return [(r["metric"], float(r["value"][1])) for r in data["result"]]


def query_range(
    prom_url: str, promql: str, start: float, end: float, step: float = 1.0, timeout: float = 10.0
) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
    params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    data = _get(prom_url, "/api/v1/query_range", params, timeout)
    return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in data["result"]]


def first_firing(
    prom_url: str,
    alertname: str,
    labels: dict[str, str] | None,
    start: float,
    end: float,
    step: float = 1.0,
) -> float | None:
    """The first time in [start, end] (at `step` resolution) at which a
    matching alert was firing, from the ALERTS series; None if never."""
    series = query_range(prom_url, _selector(alertname, labels or {}, "firing"), start, end, step)
    times = [t for _m, vals in series for t, v in vals if v == 1.0]
    return min(times) if times else None
