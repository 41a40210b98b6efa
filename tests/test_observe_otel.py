"""An experiment as OpenTelemetry spans (pyctl/observe/otel.py): to a JSON
file, and through the real OTLP/HTTP exporter to a local receiver that
decodes the protobuf request (a stand-in for a collector)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from observe_db import T0, add_experiment, make_db

pytest.importorskip("opentelemetry.sdk")
from pyctl.observe import ObserveError, otel  # noqa: E402


def test_json_file(tmp_path: Path) -> None:
    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "e1", name="tok-stall", slo_id="chat-p99", verdict="fail", fires=3)
    out = tmp_path / "spans.json"
    docs = otel.export_experiment(db, "e1", json_path=out)
    doc = json.loads(out.read_text())
    # The file is OTLP JSON: one resourceSpans with the resource's attributes,
    # the spans with hex ids, the same spans as the SDK's (docs).
    (rs,) = doc["resourceSpans"]
    res = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
    assert res["service.name"] == {"stringValue": "gpufault"}
    (ss,) = rs["scopeSpans"]
    spans = ss["spans"]
    assert [s["name"] for s in spans] == [d["name"] for d in docs]
    for s, d in zip(spans, docs, strict=True):
        assert "0x" + s["traceId"] == d["context"]["trace_id"], (s, d)
        assert "0x" + s["spanId"] == d["context"]["span_id"]
        assert len(s["traceId"]) == 32 and len(s["spanId"]) == 16
        assert ("0x" + s["parentSpanId"] if "parentSpanId" in s else None) == d["parent_id"]
        assert int(s["startTimeUnixNano"]) <= int(s["endTimeUnixNano"])
    names = [s["name"] for s in docs]
    assert names == [
        "experiment tok-stall",
        "step stall-encode",
        "fault 1a2b3c4d-1",
        "fault 1a2b3c4d-2",
        "fault 1a2b3c4d-3",
    ]
    root, step, f1 = docs[0], docs[1], docs[2]
    for s in docs:
        assert s["attributes"]["slo_id"] == "chat-p99" and s["attributes"]["verdict"] == "fail"
        assert s["context"]["trace_id"] == root["context"]["trace_id"]
    assert root["parent_id"] is None
    assert step["parent_id"] == root["context"]["span_id"]
    assert f1["parent_id"] == step["context"]["span_id"]
    assert root["status"]["status_code"] == "ERROR"
    assert f1["attributes"]["gpufault.function"] == "tok:hf-encode"
    # Real times: the step's start as recorded.
    from datetime import datetime

    start = datetime.fromisoformat(step["start_time"].replace("Z", "+00:00")).timestamp()
    assert abs(start - (T0 + 10.05)) < 1e-3
    f3 = docs[4]
    assert [e["name"] for e in f3["events"]] == ["xid", "anchor"]
    assert f3["events"][0]["attributes"]["xid"] == 31


def test_the_json_file_is_the_exporters_request_in_otlp_json(tmp_path: Path) -> None:
    """The peer: opentelemetry-proto parses the file (its ids put back in
    base64, protobuf's mapping for bytes) into the ExportTraceServiceRequest
    that the OTLP exporter itself encodes from the same spans."""
    import base64

    from google.protobuf.json_format import ParseDict
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "e1", name="tok-stall", slo_id="chat-p99", verdict="fail", fires=3)
    out = tmp_path / "spans.json"
    otel.export_experiment(db, "e1", json_path=out)
    doc = json.loads(out.read_text())

    def b64(o: Any) -> None:
        if isinstance(o, dict):
            for k, v in o.items():
                if k in ("traceId", "spanId", "parentSpanId"):
                    o[k] = base64.b64encode(bytes.fromhex(v)).decode()
                else:
                    b64(v)
        elif isinstance(o, list):
            for v in o:
                b64(v)

    b64(doc)
    got = ParseDict(doc, ExportTraceServiceRequest())
    _, spans = otel.build_spans(db, "e1")
    want = encode_spans(spans)
    # Span ids are random per build: compare all but the ids, and the shape of those.
    for req in (got, want):
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    assert len(sp.trace_id) == 16 and len(sp.span_id) == 8
                    sp.trace_id, sp.span_id, sp.parent_span_id = b"", b"", b""
                    for link in sp.links:
                        link.trace_id, link.span_id = b"", b""
    assert got == want


class Receiver(BaseHTTPRequestHandler):
    got: list[tuple[str, str, bytes]] = []

    def log_message(self, *_a: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.got.append((self.path, self.headers.get("Content-Type", ""), body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def receiver() -> Iterator[str]:
    Receiver.got = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def test_otlp_http(tmp_path: Path, receiver: str) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "e1", name="tok-stall", slo_id="chat-p99", verdict="pass", fires=2)
    otel.export_experiment(db, "e1", endpoint=receiver, timeout=5)
    assert len(Receiver.got) == 1
    path, ctype, body = Receiver.got[0]
    assert path == "/v1/traces" and ctype == "application/x-protobuf"
    req = ExportTraceServiceRequest.FromString(body)
    spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert sorted(s.name for s in spans) == sorted(
        ["experiment tok-stall", "step stall-encode", "fault 1a2b3c4d-1", "fault 1a2b3c4d-2"]
    )
    for s in spans:
        attrs = {a.key: a.value.string_value for a in s.attributes}
        assert attrs["slo_id"] == "chat-p99" and attrs["verdict"] == "pass"
    root = next(s for s in spans if s.name.startswith("experiment"))
    assert root.start_time_unix_nano == int(T0 * 1e9)
    assert root.end_time_unix_nano == int((T0 + 40) * 1e9)


def test_errors(tmp_path: Path) -> None:
    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "e1", name="x")
    with pytest.raises(ObserveError, match="not in this database"):
        otel.export_experiment(db, "nope", json_path=tmp_path / "s.json")
    with pytest.raises(ObserveError, match="give an OTLP endpoint or a JSON file"):
        otel.export_experiment(db, "e1")
    with pytest.raises(ObserveError, match="the export failed"):
        otel.export_experiment(db, "e1", endpoint="http://127.0.0.1:9", timeout=1)
    assert otel.traces_url("http://h:4318/") == "http://h:4318/v1/traces"
    assert otel.traces_url("http://h:4318/v1/traces") == "http://h:4318/v1/traces"
