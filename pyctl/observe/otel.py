"""An experiment from the evidence store as OpenTelemetry spans.

One trace per experiment: the experiment's span, a child span per step,
and under each step a span per fault it fired (linked by the step's
run_id), each with its real start and end (Unix times from the store:
experiments.started_at/ended_at, experiment_steps.started_at/ended_at,
faults.wall + latency). Every span carries `slo_id` and `verdict`; a fault
span carries its Xids and anchors as span events. A burn-rate SLO
([[slo]]) is a span of its own under the experiment's, `slo_id` its id,
its alerts' firing and resolving as events.

Sent to an OTLP/HTTP endpoint (opentelemetry-exporter-otlp-proto-http;
`http://host:4318`, /v1/traces is added) when one is given, else written to
a file in OTLP JSON: the ExportTraceServiceRequest the exporter would send,
in the protobuf JSON mapping with the OTLP rules (lowerCamelCase names,
trace and span ids as hex, enums as integers), which a collector's
otlpjsonfile receiver and `otelcol` tooling read.
Both need `pip install gpufault[observe]`; without the packages the
functions raise ObserveError saying so.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyctl.observe import ObserveError


def _rows(db: Any, sql: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
    conn = db.conn if hasattr(db, "conn") else db
    cur = conn.execute(sql, params)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def _has(db: Any, table: str) -> bool:
    conn = db.conn if hasattr(db, "conn") else db
    return bool(
        conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)
        ).fetchone()
    )


def _ns(t: float) -> int:
    return int(round(t * 1e9))


def _attrs(d: dict[str, Any]) -> dict[str, Any]:
    """Span attributes take str/bool/int/float only: drop None, keep the rest."""
    return {k: v for k, v in d.items() if v is not None}


def _sdk() -> Any:
    try:
        # lazy: opentelemetry's SDK is optional (the observe extra); only for --otel
        from opentelemetry.sdk import trace as sdk_trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )
    except ImportError:
        raise ObserveError(
            "OpenTelemetry export needs opentelemetry-sdk: pip install 'gpufault[observe]'"
        ) from None
    return sdk_trace, Resource, SimpleSpanProcessor, InMemorySpanExporter


def build_spans(db: Any, experiment_id: str) -> tuple[Any, list[Any]]:
    """(resource, finished SDK spans) of one experiment, parents first."""
    # lazy: opentelemetry (ast, contextvars, +37 modules, ~200 ms) only when this runs
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    sdk_trace, Resource, SimpleSpanProcessor, InMemorySpanExporter = _sdk()
    exps = _rows(db, "SELECT * FROM experiments WHERE id = ?", (experiment_id,))
    if not exps:
        raise ObserveError(
            f"experiment {experiment_id}: not in this database; "
            "`gpufault experiment list` shows the recorded ones"
        )
    e = exps[0]
    steps = _rows(
        db, "SELECT * FROM experiment_steps WHERE experiment_id = ? ORDER BY idx", (experiment_id,)
    )
    resource = Resource.create({"service.name": "gpufault", "host.name": e.get("host") or ""})
    mem = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(mem))
    tracer = provider.get_tracer("pyctl.observe.otel")
    common = _attrs(
        {
            "slo_id": e.get("slo_id") or "",
            "verdict": e.get("verdict") or "",
            "gpufault.experiment.id": e["id"],
        }
    )
    t_start = e.get("started_at")
    if t_start is None:
        raise ObserveError(f"experiment {experiment_id}: never started; nothing to export")
    t_end = e.get("ended_at") or max(
        [t_start, *[s["ended_at"] for s in steps if s.get("ended_at")]]
    )
    root = tracer.start_span(
        f"experiment {e.get('name') or e['id']}",
        start_time=_ns(t_start),
        attributes=_attrs(
            {
                **common,
                "gpufault.experiment.name": e.get("name"),
                "gpufault.experiment.version": e.get("version"),
                "gpufault.experiment.file": e.get("file"),
                "gpufault.experiment.reason": e.get("reason"),
            }
        ),
    )
    verdict = e.get("verdict")
    if verdict == "pass":
        root.set_status(Status(StatusCode.OK))
    elif verdict:
        root.set_status(Status(StatusCode.ERROR, f"{verdict}: {e.get('reason') or ''}"))
    root_ctx = trace.set_span_in_context(root)
    has_xids, has_anchors = _has(db, "xids"), _has(db, "anchors")
    for st in steps:
        s0 = st.get("started_at") or st.get("planned_start")
        if s0 is None:
            continue
        s1 = st.get("ended_at") or (s0 + (st.get("planned_duration") or 0))
        span = tracer.start_span(
            f"step {st.get('name') or st['idx']}",
            context=root_ctx,
            start_time=_ns(s0),
            attributes=_attrs(
                {
                    **common,
                    "gpufault.step.index": st["idx"],
                    "gpufault.step.template": st.get("template"),
                    "gpufault.step.spec": st.get("spec"),
                    "gpufault.run_id": st.get("run_id"),
                    "gpufault.step.fires": st.get("fires"),
                    "gpufault.step.status": st.get("status"),
                }
            ),
        )
        step_ctx = trace.set_span_in_context(span)
        faults = (
            _rows(db, "SELECT * FROM faults WHERE run_id = ? ORDER BY seq", (st["run_id"],))
            if st.get("run_id")
            else []
        )
        for f in faults:
            w = f.get("wall") or s0
            lat = (f.get("latency_ns") or 0) / 1e9
            fs = tracer.start_span(
                f"fault {f['fault_id']}",
                context=step_ctx,
                start_time=_ns(w),
                attributes=_attrs(
                    {
                        **common,
                        "gpufault.fault_id": f["fault_id"],
                        "gpufault.function": f.get("function"),
                        "gpufault.library": f.get("library"),
                        "gpufault.action": f.get("action"),
                        "gpufault.retval": f.get("retval"),
                        "gpufault.ret": f.get("ret"),
                        "thread.id": f.get("tid"),
                        "process.pid": f.get("pid"),
                        "thread.name": f.get("comm"),
                    }
                ),
            )
            if has_xids:
                for x in _rows(db, "SELECT * FROM xids WHERE fault_id = ?", (f["fault_id"],)):
                    at = w + ((x.get("ts_ns") or 0) - (f.get("ts_ns") or 0)) / 1e9
                    fs.add_event(
                        "xid",
                        timestamp=_ns(at),
                        attributes=_attrs(
                            {
                                "xid": x.get("error_code"),
                                "device": x.get("dev"),
                                "message": x.get("msg"),
                                "rule": x.get("rule"),
                            }
                        ),
                    )
            if has_anchors:
                for a in _rows(
                    db,
                    "SELECT kind, bdf, wall_ns, rec_seq FROM anchors WHERE fault_id = ?",
                    (f["fault_id"],),
                ):
                    fs.add_event(
                        "anchor",
                        timestamp=a.get("wall_ns") or _ns(w),
                        attributes=_attrs(
                            {
                                "kind": a.get("kind"),
                                "device": a.get("bdf"),
                                "record": a.get("rec_seq"),
                            }
                        ),
                    )
            fs.end(end_time=_ns(w + lat))
        span.end(end_time=_ns(max(s1, s0)))
    if _has(db, "slo_windows"):
        _slo_spans(db, tracer, root_ctx, e, common, Status, StatusCode)
    root.end(end_time=_ns(max(t_end, t_start)))
    spans = list(mem.get_finished_spans())
    provider.shutdown()
    # Parents first (the SDK finishes children first).
    order = {"experiment": 0, "step": 1, "slo": 1, "fault": 2}
    spans.sort(key=lambda s: (order.get(s.name.split()[0], 3), s.start_time))
    return resource, spans


def _slo_spans(
    db: Any, tracer: Any, ctx: Any, e: dict[str, Any], common: dict[str, Any],
    Status: Any, StatusCode: Any,
) -> None:  # fmt: skip
    """A span per burn-rate SLO ([[slo]]) under the experiment's, over its
    windows, with slo_id its own id; each alert pair's firing and
    resolving as events at the windows' ends."""
    xid = e["id"]
    for (sid,) in (db.conn if hasattr(db, "conn") else db).execute(
        "SELECT DISTINCT slo_id FROM slo_windows WHERE experiment_id = ? ORDER BY slo_id", (xid,)
    ):
        wins = _rows(db, "SELECT * FROM slo_windows WHERE experiment_id = ? AND slo_id = ? "
                     "ORDER BY start", (xid, sid))  # fmt: skip
        burns = _rows(db, "SELECT * FROM slo_burns WHERE experiment_id = ? AND slo_id = ? "
                      "ORDER BY alert, at", (xid, sid))  # fmt: skip
        total = sum(w["total"] or 0 for w in wins)
        good = sum(w["good"] or 0 for w in wins)
        fired = any(b["firing"] for b in burns)
        span = tracer.start_span(
            f"slo {sid}",
            context=ctx,
            start_time=_ns(wins[0]["start"]),
            attributes=_attrs({
                **common,
                "slo_id": sid,
                "gpufault.slo.file_slo_id": e.get("slo_id") or None,
                "gpufault.slo.requests": total,
                "gpufault.slo.good_requests": good,
                "gpufault.slo.alert_fired": fired,
                "gpufault.slo.max_burn_rate": max(
                    (min(b["long_burn"] or 0, b["short_burn"] or 0) for b in burns), default=0.0
                ),
            }),
        )  # fmt: skip
        was: dict[str, bool] = {}
        for b in burns:
            now = bool(b["firing"])
            if now != was.get(b["alert"], False):
                span.add_event(
                    "alert fired" if now else "alert resolved",
                    timestamp=_ns(b["at"]),
                    attributes=_attrs({
                        "slo_id": sid, "alert": b["alert"], "factor": b["factor"],
                        "long_burn": b["long_burn"], "short_burn": b["short_burn"],
                        "phase": b.get("phase"),
                    }),
                )  # fmt: skip
            was[b["alert"]] = now
        if fired:
            span.set_status(Status(StatusCode.ERROR, f"slo {sid}: a burn-rate alert fired"))
        else:
            span.set_status(Status(StatusCode.OK))
        span.end(end_time=_ns(wins[-1]["end"]))


def traces_url(endpoint: str) -> str:
    e = endpoint.rstrip("/")
    return e if e.endswith("/v1/traces") else e + "/v1/traces"


def export_experiment(
    db: Any,
    experiment_id: str,
    *,
    endpoint: str | None = None,
    json_path: str | os.PathLike[str] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> list[dict[str, Any]]:
    """Send the spans to endpoint (OTLP/HTTP protobuf), else write them to
    json_path; one of the two is needed. Returns the spans as JSON dicts."""
    if not endpoint and not json_path:
        raise ObserveError("OpenTelemetry export: give an OTLP endpoint or a JSON file")
    resource, spans = build_spans(db, experiment_id)
    docs = [json.loads(s.to_json()) for s in spans]
    if endpoint:
        send(spans, endpoint, headers=headers, timeout=timeout)
    else:
        assert json_path is not None
        p = Path(json_path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(otlp_json(spans), indent=2) + "\n")
        os.replace(tmp, p)
    return docs


_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def otlp_json(spans: Sequence[Any]) -> dict[str, Any]:
    """The spans as one OTLP JSON ExportTraceServiceRequest: the
    exporter's own protobuf encoding (opentelemetry-exporter-otlp-proto-
    common), in protobuf's JSON mapping, with the ids in hex as the OTLP
    JSON encoding asks (protobuf would write bytes as base64)."""
    try:
        # lazy: the OTLP encoder and protobuf are optional (the observe extra)
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    except ImportError:
        raise ObserveError(
            "OTLP JSON needs opentelemetry-exporter-otlp-proto-http: "
            "pip install 'gpufault[observe]'"
        ) from None
    doc = MessageToDict(encode_spans(list(spans)), use_integers_for_enums=True)
    _hex_ids(doc)
    return doc


def _hex_ids(o: Any) -> None:
    if isinstance(o, dict):
        for k, v in o.items():
            if k in _ID_KEYS and isinstance(v, str):
                o[k] = base64.b64decode(v).hex()
            else:
                _hex_ids(v)
    elif isinstance(o, list):
        for v in o:
            _hex_ids(v)


def send(
    spans: Sequence[Any],
    endpoint: str,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> None:
    try:
        # lazy: the OTLP exporter is optional (the observe extra); only to send spans
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import SpanExportResult
    except ImportError:
        raise ObserveError(
            "OTLP export needs opentelemetry-exporter-otlp-proto-http: "
            "pip install 'gpufault[observe]', or write a JSON file"
        ) from None
    exp = OTLPSpanExporter(endpoint=traces_url(endpoint), headers=headers, timeout=timeout)
    try:
        result = exp.export(list(spans))
    finally:
        exp.shutdown()
    if result != SpanExportResult.SUCCESS:
        raise ObserveError(
            f"OTLP endpoint {traces_url(endpoint)}: the export failed "
            "(not reachable, or it refused the spans); check the OTLP endpoint (http://HOST:4318)"
        )
