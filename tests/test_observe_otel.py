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
    assert doc["spans"] == docs and doc["resource"]["service.name"] == "gpufault"
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
