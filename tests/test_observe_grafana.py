"""Grafana annotations (pyctl/observe/grafana.py) against a STAND-IN for
Grafana: a stdlib HTTP server on 127.0.0.1 that accepts only what Grafana's
documented `POST /api/annotations` takes (JSON body, epoch-millisecond
time/timeEnd, a list of string tags, text, a Bearer token) and answers as
Grafana does. It is not Grafana; no live Grafana was tried."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from httpsink import serving
from observe_db import T0, add_experiment, make_db

from pyctl.observe import ObserveError, grafana

TOKEN = "glsa_test_token"
ALLOWED = {"time", "timeEnd", "tags", "text", "dashboardUID", "panelId"}


class GrafanaStandIn(BaseHTTPRequestHandler):
    got: list[dict[str, Any]] = []
    problems: list[str] = []

    def log_message(self, *_a: Any) -> None:
        pass

    def _answer(self, code: int, doc: dict[str, Any]) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path != "/api/annotations":
            return self._answer(404, {"message": "Not found"})
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._answer(401, {"message": "Unauthorized"})
        if self.headers.get("Content-Type") != "application/json":
            self.problems.append(f"content type {self.headers.get('Content-Type')}")
        doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        bad = set(doc) - ALLOWED
        if bad:
            self.problems.append(f"unknown fields {bad}")
        if not isinstance(doc.get("time"), int) or doc["time"] < 10**12:
            self.problems.append(f"time not epoch ms: {doc.get('time')!r}")
        if "timeEnd" in doc and (
            not isinstance(doc["timeEnd"], int) or doc["timeEnd"] < doc["time"]
        ):
            self.problems.append(f"bad timeEnd {doc.get('timeEnd')!r}")
        if not isinstance(doc.get("tags"), list) or not all(
            isinstance(t, str) for t in doc["tags"]
        ):
            self.problems.append("tags not a list of strings")
        if not isinstance(doc.get("text"), str):
            self.problems.append("no text")
        self.got.append(doc)
        self._answer(200, {"message": "Annotation added", "id": len(self.got)})


@pytest.fixture
def stand_in() -> Iterator[str]:
    GrafanaStandIn.got, GrafanaStandIn.problems = [], []
    with serving(GrafanaStandIn) as url:
        yield url


def test_annotations_posted_and_written(tmp_path: Path, stand_in: str) -> None:
    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "e1", name="tokenizer-stall", slo_id="chat-p99")
    out = tmp_path / "ann.json"
    anns = grafana.publish(
        db, "e1", out, grafana_url=stand_in, token=TOKEN, dashboard_uid="gf-dash", panel_id=2
    )
    assert GrafanaStandIn.problems == []
    assert len(GrafanaStandIn.got) == 1
    a = GrafanaStandIn.got[0]
    assert a["time"] == round((T0 + 10.05) * 1000) and a["timeEnd"] == round((T0 + 25.02) * 1000)
    assert {
        "gpufault",
        "experiment:tokenizer-stall",
        "slo_id:chat-p99",
        "step:stall-encode",
        "run:1a2b3c4d",
    } <= set(a["tags"])
    assert a["dashboardUID"] == "gf-dash" and a["panelId"] == 2
    assert "tokenizer-stall" in a["text"] and "6 fires" in a["text"]
    # The file holds the same annotations, with the ids Grafana gave.
    assert json.loads(out.read_text()) == anns and anns[0]["grafana_id"] == 1
    assert {k: v for k, v in anns[0].items() if k != "grafana_id"} == a


def test_json_only_without_grafana(tmp_path: Path, stand_in: str) -> None:
    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "e1", name="x")
    out = tmp_path / "ann.json"
    anns = grafana.publish(db, "e1", out)
    assert GrafanaStandIn.got == [] and json.loads(out.read_text()) == anns
    assert "dashboardUID" not in anns[0] and "grafana_id" not in anns[0]


def test_errors_are_one_line(tmp_path: Path, stand_in: str) -> None:
    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "e1", name="x")
    with pytest.raises(ObserveError, match="HTTP 401: Unauthorized; check the token"):
        grafana.publish(db, "e1", tmp_path / "a.json", grafana_url=stand_in, token="wrong")
    with pytest.raises(ObserveError, match="needs a token"):
        grafana.publish(db, "e1", tmp_path / "a.json", grafana_url=stand_in)
    with pytest.raises(ObserveError, match="experiment nope: not in this database"):
        grafana.publish(db, "nope", tmp_path / "a.json")
    with pytest.raises(ObserveError, match="check the Grafana URL"):
        grafana.post("http://127.0.0.1:9", TOKEN, {"time": 1, "tags": [], "text": ""}, 2)


def test_step_never_started_and_running() -> None:
    exp = {"id": "e", "name": "n", "slo_id": "s"}
    assert grafana.step_annotation(exp, {"idx": 0, "started_at": None}) is None
    a = grafana.step_annotation(exp, {"idx": 1, "started_at": T0, "ended_at": None})
    assert a is not None and "timeEnd" not in a and a["time"] == round(T0 * 1000)
