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
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import requires_root
from observe_db import add_experiment, make_db

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
            out, ctype, ok = b"", "application/x-protobuf", self.path == "/v1/traces"
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def sink() -> Iterator[str]:
    _Sink.got = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


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
        f"otlp: 5 spans written to {spans} (OTLP JSON)",
        f"grafana: 1 annotations posted to {sink}",
        f"grafana: 1 annotations written to {anns}",
    ]
    (traces,) = [b for p, _, b in _Sink.got if p == "/v1/traces"]
    req = ExportTraceServiceRequest.FromString(traces)
    sent = [s.name for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    doc = json.loads(spans.read_text())
    written = [s["name"] for s in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]]
    assert sent == written and written[0] == "experiment tok-stall"
    (ann,) = [json.loads(b) for p, _, b in _Sink.got if p == "/api/annotations"]
    assert "experiment:tok-stall" in ann["tags"]
    (stored,) = json.loads(anns.read_text())
    assert stored["grafana_id"] == 2 and stored["tags"] == ann["tags"]


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
    assert "otlp: 1 spans written to" in r.stdout and "grafana: 0 annotations written" in r.stdout
    (root,) = json.loads(spans.read_text())["resourceSpans"][0]["scopeSpans"][0]["spans"]
    attrs = {a["key"]: a["value"] for a in root["attributes"]}
    assert root["name"] == "experiment control" and attrs["verdict"] == {"stringValue": "pass"}
    assert json.loads(anns.read_text()) == []  # control has no steps
    assert os.stat(spans).st_size > 0
