"""An experiment's per-window series as OTLP metrics: one
ExportMetricsServiceRequest in the OTLP JSON encoding (opentelemetry-
proto's metrics.proto through protobuf's JSON mapping: lowerCamelCase
names, 64-bit integers as decimal strings, enums as integers), built from
the evidence store, for an OTLP/HTTP endpoint (POST /v1/metrics,
Content-Type application/json) or a file.

Why from the store, after the run, and not an SDK MeterProvider during
it: the points must carry the windows' own times (a 1 s load window ends
at its end, not when an exporter happened to collect), and the store is
the one record the report, the spans and these agree on. Nothing here
needs the OpenTelemetry packages: the request is plain JSON.

Every data point carries gpufault.experiment.run (the experiment's id)
and slo_id: the file's slo_id, or a burn-rate SLO's own id on its series.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from pyctl.observe import ObserveError

SCOPE = "pyctl.observe.otlp_metrics"
CUMULATIVE = 2  # AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
# load_windows columns as gauges: (metric, unit, description, [(column, extra attributes)])
_WINDOW_GAUGES: tuple[tuple[str, str, str, tuple[tuple[str, dict[str, str]], ...]], ...] = (
    ("gpufault.load.latency", "s", "end-to-end latency percentile of the requests due in a 1 s "
     "window", (("p50", {"quantile": "0.5"}), ("p95", {"quantile": "0.95"}),
                ("p99", {"quantile": "0.99"}))),
    ("gpufault.load.ttft", "s", "time to first token percentile of a 1 s window (streamed)",
     (("ttft_p50", {"quantile": "0.5"}), ("ttft_p95", {"quantile": "0.95"}),
      ("ttft_p99", {"quantile": "0.99"}))),
    ("gpufault.load.itl", "s", "inter-token latency percentile of a 1 s window (every gap "
     "between token chunks)", (("itl_p50", {"quantile": "0.5"}), ("itl_p95", {"quantile": "0.95"}),
                               ("itl_p99", {"quantile": "0.99"}))),
    ("gpufault.load.throughput", "{request}/s", "successful answers per second of a 1 s window",
     (("throughput", {}),)),
    ("gpufault.load.output_tokens", "{token}/s", "output tokens per second of a 1 s window",
     (("output_tokens_per_s", {}),)),
    ("gpufault.load.error_rate", "1", "failed requests / requests of a 1 s window",
     (("error_rate", {}),)),
    ("gpufault.load.goodput", "1", "share of a 1 s window's requests meeting every per-request "
     "bound", (("goodput", {}),)),
    ("gpufault.load.requests", "{request}", "requests due in a 1 s window", (("count", {}),)),
)  # fmt: skip


def _rows(db: Any, sql: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
    conn = db.conn if hasattr(db, "conn") else db
    if not conn.execute(
        "SELECT 1 FROM sqlite_master WHERE name = ? AND type IN ('table', 'view')",
        (sql.split(" FROM ", 1)[1].split()[0],),
    ).fetchone():
        return []  # an older store without the table: no such series
    cur = conn.execute(sql, params)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def _ns(t: float) -> str:
    return str(int(round(t * 1e9)))


def _attrs(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for k, v in d.items():
        if v is None:
            continue
        if isinstance(v, bool):
            val: dict[str, Any] = {"boolValue": v}
        elif isinstance(v, int):
            val = {"intValue": str(v)}
        elif isinstance(v, float):
            val = {"doubleValue": v}
        else:
            val = {"stringValue": str(v)}
        out.append({"key": k, "value": val})
    return out


def _gauge(name: str, unit: str, desc: str, points: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "unit": unit, "description": desc, "gauge": {"dataPoints": points}}


def _sum(name: str, unit: str, desc: str, points: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": name,
        "unit": unit,
        "description": desc,
        "sum": {
            "dataPoints": points,
            "aggregationTemporality": CUMULATIVE,
            "isMonotonic": True,
        },
    }


def build(db: Any, experiment_id: str) -> dict[str, Any]:
    """The ExportMetricsServiceRequest of one experiment, as OTLP JSON."""
    exps = _rows(db, "SELECT * FROM experiments WHERE id = ?", (experiment_id,))
    if not exps:
        raise ObserveError(
            f"experiment {experiment_id}: not in this database; "
            "`gpufault experiment list` shows the recorded ones"
        )
    e = exps[0]
    t0 = e.get("started_at")
    if t0 is None:
        raise ObserveError(f"experiment {experiment_id}: never started; nothing to export")
    run = {
        "gpufault.experiment.run": e["id"],
        "gpufault.experiment.name": e.get("name") or "",
    }
    file_slo = e.get("slo_id") or ""

    def point(at: float, value: float | int, start: float, **attrs: Any) -> dict[str, Any]:
        p: dict[str, Any] = {
            "attributes": _attrs({**run, "slo_id": file_slo, **attrs}),
            "startTimeUnixNano": _ns(start),
            "timeUnixNano": _ns(at),
        }
        if isinstance(value, int) and not isinstance(value, bool):
            p["asInt"] = str(value)
        else:
            p["asDouble"] = float(value)
        return p

    metrics: list[dict[str, Any]] = []
    wins = _rows(
        db, "SELECT * FROM load_windows WHERE experiment_id = ? ORDER BY start", (experiment_id,)
    )
    for name, unit, desc, cols in _WINDOW_GAUGES:
        pts = [
            point(w["end"], w[col], w["start"], phase=w.get("phase"), **extra)
            for w in wins
            for col, extra in cols
            if w.get(col) is not None
        ]
        if pts:
            metrics.append(_gauge(name, unit, desc, pts))
    # Burn-rate SLOs: their requests (cumulative) and each pair's burn rates.
    sw = _rows(db, "SELECT * FROM slo_windows WHERE experiment_id = ? ORDER BY slo_id, start",
               (experiment_id,))  # fmt: skip
    req, good = [], []
    acc: dict[str, tuple[int, int, float]] = {}  # slo_id -> (requests, good, first start)
    for w in sw:
        n, g, first = acc.get(w["slo_id"], (0, 0, w["start"]))
        n, g = n + (w["total"] or 0), g + (w["good"] or 0)
        acc[w["slo_id"]] = (n, g, first)
        req.append(point(w["end"], n, first, slo_id=w["slo_id"]))
        good.append(point(w["end"], g, first, slo_id=w["slo_id"]))
    if req:
        metrics.append(_sum("gpufault.slo.requests", "{request}",
                            "requests a burn-rate SLO counted so far", req))  # fmt: skip
        metrics.append(_sum("gpufault.slo.good_requests", "{request}",
                            "good requests (no error, every bound met) so far", good))  # fmt: skip
    bs = _rows(db, "SELECT * FROM slo_burns WHERE experiment_id = ? ORDER BY slo_id, alert, at",
               (experiment_id,))  # fmt: skip
    burn_pts, fire_pts = [], []
    for b in bs:
        lab = {"slo_id": b["slo_id"], "alert": b["alert"], "phase": b.get("phase")}
        for window, col, span in (("long", "long_burn", "long_s"), ("short", "short_burn",
                                                                    "short_s")):  # fmt: skip
            if b.get(col) is not None:
                burn_pts.append(point(b["at"], b[col], b["at"] - (b[span] or 0), window=window,
                                      **lab))  # fmt: skip
        fire_pts.append(point(b["at"], int(b["firing"] or 0), b["at"], **lab))
    if burn_pts:
        metrics.append(_gauge("gpufault.slo.burn_rate", "1", "bad share over the window / "
                              "error budget, at the window's end", burn_pts))  # fmt: skip
        metrics.append(_gauge("gpufault.slo.alert.firing", "1", "1 while both windows of the "
                              "alert pair burn above its factor", fire_pts))  # fmt: skip
    # Fires per step, cumulative, a point at each fire's second.
    fired: list[dict[str, Any]] = []
    for st in _rows(db, "SELECT * FROM experiment_steps WHERE experiment_id = ? ORDER BY idx",
                    (experiment_id,)):  # fmt: skip
        if not st.get("run_id"):
            continue
        s0 = st.get("started_at") or st.get("planned_start") or t0
        n = 0
        by_s: dict[int, int] = {}
        for f in _rows(db, "SELECT wall FROM faults WHERE run_id = ? ORDER BY wall",
                       (st["run_id"],)):  # fmt: skip
            if f.get("wall") is None:
                continue
            by_s[int(f["wall"] - s0)] = by_s.get(int(f["wall"] - s0), 0) + 1
        for sec in sorted(by_s):
            n += by_s[sec]
            fired.append(point(s0 + sec + 1, n, s0, **{
                "gpufault.step": st["idx"] + 1,  # the CLI's numbering: step 1 is the first
                "gpufault.step.name": st.get("name"),
                "gpufault.run_id": st["run_id"],
            }))  # fmt: skip
    if fired:
        metrics.append(_sum("gpufault.faults.fired", "{fault}", "faults a step fired so far",
                            fired))  # fmt: skip
    resource = {"attributes": _attrs({"service.name": "gpufault",
                                      "host.name": e.get("host") or ""})}  # fmt: skip
    return {
        "resourceMetrics": [
            {
                "resource": resource,
                "scopeMetrics": [{"scope": {"name": SCOPE}, "metrics": metrics}],
            }
        ]
    }


def points(doc: dict[str, Any]) -> int:
    """How many data points a request holds (the CLI's line says so)."""
    n = 0
    for rm in doc.get("resourceMetrics", []):
        for sm in rm.get("scopeMetrics", []):
            for m in sm.get("metrics", []):
                for kind in ("gauge", "sum"):
                    n += len(m.get(kind, {}).get("dataPoints", []))
    return n


def metrics_url(endpoint: str) -> str:
    e = endpoint.rstrip("/")
    if e.endswith("/v1/traces"):
        e = e[: -len("/v1/traces")]
    return e if e.endswith("/v1/metrics") else e + "/v1/metrics"


def send(
    doc: dict[str, Any],
    endpoint: str,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> None:
    """POST the request as OTLP/HTTP JSON; ObserveError (one line) unless 2xx."""
    url = metrics_url(endpoint)
    req = urllib.request.Request(
        url,
        data=json.dumps(doc).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
    except urllib.error.HTTPError as err:
        raise ObserveError(
            f"OTLP endpoint {url}: the metrics were refused (HTTP {err.code}); "
            "check the OTLP endpoint (http://HOST:4318)"
        ) from None
    except (OSError, ValueError) as err:
        raise ObserveError(
            f"OTLP endpoint {url}: the metrics export failed ({err}); "
            "check the OTLP endpoint (http://HOST:4318)"
        ) from None


__all__ = ["build", "metrics_url", "points", "send"]
