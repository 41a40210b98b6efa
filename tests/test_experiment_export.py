"""An experiment's record to OpenTelemetry and Grafana from the command
line (issue 23): `gpufault experiment export ID` and `experiment run
--otlp-file/--otlp-endpoint/--grafana-url/--annotations-file`. The spans
go to a local OTLP/HTTP receiver that decodes them with opentelemetry-
proto and to an OTLP JSON file; the annotations to a stand-in of
Grafana's annotations API (stdlib, named as one) and a JSON file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import requires_root
from httpsink import serving
from observe_db import add_experiment, add_streaming_and_slo, make_db

pytest.importorskip("opentelemetry.sdk")
from pyctl.cli import cli  # noqa: E402

TOKEN = "glsa_export_test_token_0123"


class _Sink(BaseHTTPRequestHandler):
    got: list[tuple[str, dict[str, str], bytes]] = []

    def log_message(self, *_a: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.got.append((self.path, dict(self.headers), body))
        if self.path == "/api/annotations":
            out = json.dumps({"message": "Annotation added", "id": len(self.got)}).encode()
            ctype = "application/json"
            ok = self.headers.get("Authorization") == f"Bearer {TOKEN}"
        else:
            out, ctype = b"", "application/x-protobuf"
            ok = self.path in ("/v1/traces", "/v1/metrics")
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def sink() -> Iterator[str]:
    _Sink.got = []
    with serving(_Sink) as url:
        yield url


def _token(tmp_path: Path, mode: int = 0o600) -> Path:
    p = tmp_path / "grafana.token"
    p.write_text(TOKEN + "\n")
    p.chmod(mode)
    return p


@requires_root  # the token file must be root's
def test_export_sends_spans_and_annotations_everywhere_asked(tmp_path: Path, sink: str) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "e1", name="tok-stall", slo_id="chat-p99", verdict="fail", fires=3)
    db.close()
    spans, anns = tmp_path / "spans.json", tmp_path / "annotations.json"
    r = CliRunner().invoke(cli, [
        "experiment", "export", "e1", "--db", str(tmp_path / "gf.db"), "--otlp-file", str(spans),
        "--otlp-endpoint", sink, "--grafana-url", sink, "--grafana-token-file",
        str(_token(tmp_path)), "--annotations-file", str(anns)])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == [
        f"otlp: 5 spans sent to {sink}/v1/traces",
        f"otlp: 243 metric points sent to {sink}/v1/metrics",
        f"otlp: 5 spans and 243 metric points written to {spans} (OTLP JSON Lines: traces, "
        "metrics)",
        f"grafana: 1 annotations posted to {sink}",
        f"grafana: 1 annotations written to {anns}",
    ]
    (traces,) = [b for p, _, b in _Sink.got if p == "/v1/traces"]
    req = ExportTraceServiceRequest.FromString(traces)
    sent = [s.name for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    doc = json.loads(spans.read_text().splitlines()[0])
    written = [s["name"] for s in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]]
    assert sent == written and written[0] == "experiment tok-stall"
    (ann,) = [json.loads(b) for p, _, b in _Sink.got if p == "/api/annotations"]
    assert "experiment:tok-stall" in ann["tags"]
    (stored,) = json.loads(anns.read_text())
    # The sink numbers requests: traces, metrics, then the annotation.
    assert stored["grafana_id"] == 3 and stored["tags"] == ann["tags"]


def test_the_grafana_token_may_come_from_the_environment(
    tmp_path: Path, sink: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "e1", name="tok-stall", slo_id="chat-p99", verdict="fail", fires=3)
    db.close()
    monkeypatch.setenv("GPUFAULT_GRAFANA_TOKEN", TOKEN)
    r = CliRunner().invoke(cli, ["experiment", "export", "e1", "--db", str(tmp_path / "gf.db"),
                                 "--grafana-url", sink])  # fmt: skip
    assert r.exit_code == 0 and r.output == f"grafana: 1 annotations posted to {sink}\n", r.output
    ((_, headers, _),) = _Sink.got
    assert headers["Authorization"] == f"Bearer {TOKEN}" and TOKEN not in r.output


@requires_root
def test_bad_exports_are_one_line(tmp_path: Path) -> None:
    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "e1", name="tok-stall", slo_id="chat-p99", verdict="fail", fires=3)
    db.close()
    base = ["experiment", "export", "e1", "--db", str(tmp_path / "gf.db")]
    for extra, why in (
        ([], "say where it goes"),
        (["--grafana-url", "http://127.0.0.1:9"], "needs --grafana-token-file"),
        (["--grafana-url", "http://127.0.0.1:9", "--grafana-token-file",
          str(_token(tmp_path, 0o644))], "others can read it"),
        (["--otlp-endpoint", "http://127.0.0.1:9"], "the export failed"),
    ):  # fmt: skip
        r = CliRunner().invoke(cli, [*base, *extra])
        assert r.exit_code == 2 and why in r.output, (extra, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output


@requires_root
def test_a_run_writes_its_spans_and_annotations_when_it_ends(tmp_path: Path) -> None:
    spans, anns = tmp_path / "spans.json", tmp_path / "annotations.json"
    r = subprocess.run([sys.executable, "-m", "pyctl", "experiment", "run", "control", "--db",
                        str(tmp_path / "exp.db"), "--otlp-file", str(spans),
                        "--annotations-file", str(anns), "--set", "p99=2s"],
                       capture_output=True, text=True, timeout=180, cwd="/")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "otlp: 1 spans and " in r.stdout and "grafana: 0 annotations written" in r.stdout
    traces, metrics = spans.read_text().splitlines()
    (root,) = json.loads(traces)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    names = {m["name"] for m in json.loads(metrics)["resourceMetrics"][0]["scopeMetrics"][0][
        "metrics"]}  # fmt: skip
    assert {"gpufault.load.latency", "gpufault.load.requests"} <= names, names
    attrs = {a["key"]: a["value"] for a in root["attributes"]}
    assert root["name"] == "experiment control" and attrs["verdict"] == {"stringValue": "pass"}
    assert json.loads(anns.read_text()) == []  # control has no steps
    assert os.stat(spans).st_size > 0


def _labels(attrs: Any) -> dict[str, Any]:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in attrs}


def test_metrics_are_otlp_json_that_protobuf_parses_with_the_run_and_slo_ids(
    tmp_path: Path, sink: str
) -> None:
    # The same request to the endpoint (OTLP/HTTP JSON) and in the file's
    # second line; opentelemetry-proto's ExportMetricsServiceRequest and
    # protobuf's JSON parser read both, and every point names the run.
    from google.protobuf.json_format import Parse
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "x0000e1e1", name="tok-stall", slo_id="chat-p99", verdict="fail")
    add_streaming_and_slo(db, "x0000e1e1")
    db.close()
    out = tmp_path / "otlp.jsonl"
    r = CliRunner().invoke(cli, ["experiment", "export", "x0000e1e1", "--db",
                                 str(tmp_path / "gf.db"), "--otlp-file", str(out),
                                 "--otlp-endpoint", sink])  # fmt: skip
    assert r.exit_code == 0, r.output
    (sent_path, headers, body), = [g for g in _Sink.got if g[0] == "/v1/metrics"]
    assert headers["Content-Type"] == "application/json"
    traces_line, metrics_line = out.read_text().splitlines()
    Parse(traces_line, ExportTraceServiceRequest())
    sent = Parse(body.decode(), ExportMetricsServiceRequest())
    written = Parse(metrics_line, ExportMetricsServiceRequest())
    assert sent == written
    (rm,) = written.resource_metrics
    by = {m.name: m for sm in rm.scope_metrics for m in sm.metrics}
    assert {"gpufault.load.latency", "gpufault.load.ttft", "gpufault.load.itl",
            "gpufault.load.throughput", "gpufault.load.output_tokens", "gpufault.slo.requests",
            "gpufault.slo.good_requests", "gpufault.slo.burn_rate", "gpufault.slo.alert.firing",
            "gpufault.faults.fired"} <= set(by), sorted(by)  # fmt: skip
    for m in by.values():
        pts = m.gauge.data_points if m.HasField("gauge") else m.sum.data_points
        assert pts, m.name
        for p in pts:
            lab = _labels(p.attributes)
            assert lab["gpufault.experiment.run"] == "x0000e1e1", (m.name, lab)
            assert lab["slo_id"] == ("chat-good" if m.name.startswith("gpufault.slo.")
                                     else "chat-p99"), (m.name, lab)  # fmt: skip
    # The per-window ITL p99 at its window's end: the fault's 68 ms, the baseline's 8 ms.
    itl = {(_labels(p.attributes)["phase"], round(p.as_double, 3))
           for p in by["gpufault.load.itl"].gauge.data_points
           if _labels(p.attributes)["quantile"] == "0.99"}  # fmt: skip
    assert itl == {("baseline", 0.008), ("fault", 0.068), ("recovery", 0.008), ("after", 0.008)}
    firing = [p for p in by["gpufault.slo.alert.firing"].gauge.data_points if p.as_int == 1]
    assert firing and all(_labels(p.attributes)["alert"] == "14.4x 12s/1s" for p in firing)
    assert by["gpufault.slo.requests"].sum.is_monotonic
    last = max(by["gpufault.slo.requests"].sum.data_points, key=lambda p: p.time_unix_nano)
    assert last.as_int == 40 * 50
    fired = max(p.as_int for p in by["gpufault.faults.fired"].sum.data_points)
    assert fired == 6  # add_experiment's six fires, counted up to the last
    fired_pts = by["gpufault.faults.fired"].sum.data_points
    (step,) = {_labels(p.attributes)["gpufault.step"] for p in fired_pts}
    assert step == 1  # the CLI's step numbering


def test_the_slo_is_a_span_with_its_id_and_its_alert_as_events(tmp_path: Path) -> None:
    from pyctl.observe import otel

    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "x0000e1e1", name="tok-stall", slo_id="chat-p99", verdict="fail")
    add_streaming_and_slo(db, "x0000e1e1")
    _, spans = otel.build_spans(db, "x0000e1e1")
    db.close()
    (slo,) = [s for s in spans if s.name == "slo chat-good"]
    assert slo.attributes["slo_id"] == "chat-good"
    assert slo.attributes["gpufault.slo.alert_fired"] is True
    assert [e.name for e in slo.events] == ["alert fired", "alert resolved"]
    assert slo.parent is not None and slo.parent.span_id == spans[0].context.span_id
