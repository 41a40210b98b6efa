"""Streaming and chat (issue 23's load side): the reference service's
Server-Sent Events and /v1/chat/completions read by a raw HTTP client;
the load generator's time to first token, inter-token gaps and output
tokens against a server of known timing; [load] method/url/headers/body/
stream and the TTFT/ITL/goodput terms of the steady state; and, as root,
a decode stall that breaks an ITL bound while a loose e2e bound holds,
with the header's secret nowhere in the store.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from expfile import header
from service_proc import ServiceProc

from pyctl import paths
from pyctl.experiment import corpora
from pyctl.experiment import load as F
from pyctl.experiment.loadgen import (
    _SSE,
    OpenLoopLoad,
    Sample,
    answer_text,
    window_stats,
    windows,
)
from pyctl.experiment.model import ExperimentError, GoodBounds
from pyctl.experiment.probes import Tolerance

REPO = Path(__file__).resolve().parent.parent


# ---- the reference service: SSE and chat, read with a raw client ----------------------------


def sse(raw: bytes) -> list[Any]:
    """The data of each event of a text/event-stream body ("[DONE]" as is)."""
    out: list[Any] = []
    for ev in raw.decode().split("\n\n"):
        data = "\n".join(ln[5:].lstrip() for ln in ev.splitlines() if ln.startswith("data:"))
        if data:
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def post(s: ServiceProc, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    return s.request("POST", path, json.dumps(body).encode())


@pytest.fixture(scope="module")
def service():
    s = ServiceProc("--batch-wait", "0")
    try:
        yield s
    finally:
        s.close()


def test_completion_stream_is_sse_token_by_token_with_usage(service: ServiceProc) -> None:
    st, plain = service.complete("hello world", 6)
    assert st == 200
    st, h, raw = post(
        service,
        "/v1/completions",
        {
            "prompt": "hello world",
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert st == 200 and h["Content-Type"] == "text/event-stream", (st, h, raw)
    assert h.get("Transfer-Encoding") == "chunked"
    evs = sse(raw)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    last = chunks[-2]
    assert last["choices"][0]["finish_reason"] == "length" and last["degraded"] is False
    toks = [c for c in chunks[:-2] if c["choices"][0]["text"]]
    assert 1 <= len(toks) <= 6 and all(c["choices"][0]["finish_reason"] is None for c in toks)
    # Greedy: the streamed text is the non-streamed answer, piece by piece.
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == plain["choices"][0]["text"]


def test_chat_answers_and_streams_in_openai_shapes(service: ServiceProc) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    st, _h, raw = post(service, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5})
    assert st == 200, raw
    ans = json.loads(raw)
    assert ans["object"] == "chat.completion" and ans["id"].startswith("chatcmpl-")
    msg = ans["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert ans["usage"]["completion_tokens"] == 5
    st, h, raw = post(
        service, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "stream": True}
    )
    assert st == 200 and h["Content-Type"] == "text/event-stream"
    evs = sse(raw)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == msg["content"]


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "'stream' must be true or false"),
        ("/v1/completions", {"prompt": "x", "stream_options": {}}, "only with 'stream': true"),
        ("/v1/chat/completions", {"messages": "hi"}, "missing 'messages'"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, "role of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "content"),
    ],
)
def test_bad_stream_and_chat_bodies_are_one_line_400s(
    service: ServiceProc, path: str, body: dict[str, Any], words: str
) -> None:
    st, _h, raw = post(service, path, body)
    assert st == 400 and raw.count(b"\n") == 1, raw
    assert words in json.loads(raw)["error"]["message"]


def test_a_client_gone_mid_stream_costs_the_service_nothing_and_streams_are_counted(
    service: ServiceProc,
) -> None:
    def ok_requests() -> float:
        return sum(
            v
            for (n, lab), v in service.metric_samples().items()
            if n == "gf_service_requests_total" and dict(lab).get("status") == "200"
        )

    before = ok_requests()
    body = json.dumps({"prompt": "hello world", "max_tokens": 64, "stream": True}).encode()
    with socket.create_connection((service.host, service.port), timeout=10) as c:
        c.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert c.recv(4096).startswith(b"HTTP/1.1 200 OK")  # then it goes away
    # The service goes on answering, streamed or not, and counted each.
    st, _h, raw = post(service, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True})
    assert st == 200 and sse(raw)[-1] == "[DONE]"
    assert service.complete("x", 2)[0] == 200
    h = service.health()[1]
    assert h["status"] == "ok" and h["worker"]["alive"], h
    after = ok_requests()
    assert after >= before + 2, (before, after)


def test_loadgen_streams_the_service_completions_and_chat(service: ServiceProc) -> None:
    L = F.Load(20, "hello world", 6, 5.0, "/v1/chat/completions", 8, stream=True)
    L.body = {
        "messages": [{"role": "user", "content": "$prompt"}],
        "max_tokens": "$max_tokens",
        "stream": True,
    }
    for path, bodies in (("/v1/completions", None), (L.path, corpora.bodies(L, 1))):
        load = OpenLoopLoad(
            service.url,
            20,
            max_tokens=6,
            path=path,
            stream=True,
            bodies=bodies,
            duration=1.0,
            keep_text=True,
            concurrency=8,
        )
        load.start()
        assert load.wait(30)
        load.stop()
        got = load.samples()
        assert len(got) == 20 and all(s.ok for s in got), load.counts()
        for s in got:
            # The service sends one chunk per token; no usage chunk was asked
            # for, so the tokens are the chunks counted.
            assert s.tokens == 6 and len(s.itl) == 5 and s.text, s
            assert 0 < s.ttft <= s.latency
            # The last token chunk comes before the end (the finish chunk, [DONE]).
            assert s.ttft + sum(s.itl) <= s.latency + 1e-9
        w = window_stats(got, got[0].due, got[-1].due + 1e-3)
        assert 0 < w.ttft_p50 <= w.ttft_p99 and 0 <= w.itl_p50 <= w.itl_p99
        assert w.output_tokens_per_s == pytest.approx(6 * 20 / (got[-1].due + 1e-3 - got[0].due))


# ---- the load generator against a stream of known timing ------------------------------------


class _SSEHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: Any

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        n = int(self.headers["Content-Length"])
        body = json.loads(self.rfile.read(n))
        self.server.seen.append((dict(self.headers), body))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        first, gap, k = self.server.timing

        def chunk(obj: Any) -> None:
            ev = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode())
            ev += b"\r\n\r\n"  # CRLF event ends, as some servers write them
            self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            self.wfile.flush()

        time.sleep(first)
        for i in range(k):
            if i:
                time.sleep(gap)
            chunk({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]})
        chunk({"choices": [], "usage": {"completion_tokens": k + 10}})  # usage wins
        chunk(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def timed_sse():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _SSEHandler)
    srv.daemon_threads = True
    srv.seen = []  # type: ignore[attr-defined]
    srv.timing = (0.050, 0.020, 4)  # type: ignore[attr-defined]
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def test_ttft_itl_and_tokens_match_a_stream_of_known_timing(timed_sse: Any) -> None:
    url = f"http://127.0.0.1:{timed_sse.server_address[1]}/v1/chat/completions"
    load = OpenLoopLoad(
        url,
        10,
        body=b'{"messages": [], "stream": true}',
        headers={"Authorization": "Bearer s3cret", "X-Team": "load"},
        stream=True,
        duration=0.5,
        keep_text=True,
    )
    load.start()
    assert load.wait(10)
    load.stop()
    got = load.samples()
    assert len(got) == 5 and all(s.ok for s in got), load.counts()
    for s in got:
        assert 0.050 <= s.ttft < 0.050 + 0.030, s
        assert len(s.itl) == 3 and all(0.020 <= g < 0.020 + 0.015 for g in s.itl), s
        assert s.tokens == 14 and s.text == "t0 t1 t2 t3 "
    hdrs = [h for h, _b in timed_sse.seen]
    assert all(h["Authorization"] == "Bearer s3cret" and h["X-Team"] == "load" for h in hdrs)


def test_a_stream_cut_before_done_or_with_an_error_event_is_an_error() -> None:
    s = Sample(due=0, done=1, latency=1, status=200, error="")
    assert s.ok and math.isnan(s.tpot)
    p = _SSE()
    p.feed(b'data: {"choices": [{"text": "a"}]}\n\ndata: {"error": {"message": "boom"}}\n\n', 1.0)
    assert p.error and p.token_at == [1.0] and not p.done
    load = OpenLoopLoad("http://127.0.0.1:9", 1, stream=True)
    load._record(0.0, 0.5, 200, "", 0.1, 0, p)
    assert load.samples()[0].error == "stream-error"
    cut = _SSE()
    cut.feed(b'data: {"choices": [{"text": "a"}]}\n\n', 2.0)
    load._record(1.0, 1.5, 200, "", 1.1, 1, cut)
    assert load.samples()[1].error == "stream-cut"


def test_goodput_counts_requests_meeting_every_per_request_bound() -> None:
    def smp(due: float, ttft: float, itl: tuple[float, ...], error: str = "") -> Sample:
        lat = ttft + sum(itl)
        return Sample(due, due + lat, lat, 200, error, ttft=ttft, itl=itl, tokens=len(itl) + 1)

    good = GoodBounds(
        ttft=Tolerance.bound("<= 100ms", "duration"), itl=Tolerance.bound("<= 30ms", "duration")
    )
    xs = [
        smp(0.0, 0.05, (0.01, 0.01)),  # good
        smp(0.1, 0.20, (0.01,)),  # ttft too long
        smp(0.2, 0.05, (0.01, 0.05)),  # one gap too long
        smp(0.3, 0.05, (0.01,), error="http-500"),  # an error is never good
    ]
    w = window_stats(xs, 0, 1, good)
    assert w.goodput == 0.25
    assert math.isnan(window_stats(xs, 0, 1).goodput)  # no bounds: no goodput
    assert [x.goodput for x in windows(xs, 0, 0.2, 0.1, good)] == [1.0, 0.0]
    assert w.itl_p99 == pytest.approx(sorted([0.01] * 4 + [0.05] * 1 + [0.01])[-1], abs=0.005)


# ---- [load] and [steady_state] keys ---------------------------------------------------------

BASE = header("s")


def exp(tmp_path: Path, text: str):
    p = tmp_path / "s.toml"
    p.write_text(BASE + text)
    return F.load_file(p)


def refusal(tmp_path: Path, text: str) -> str:
    with pytest.raises(ExperimentError) as ei:
        exp(tmp_path, text)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_load_keys_method_url_headers_body_stream(tmp_path: Path, monkeypatch) -> None:
    e = exp(
        tmp_path,
        """
[load]
url = "http://127.0.0.1:9/v1/chat/completions"
method = "post"
stream = true
[load.headers]
Authorization = { env = "GF_TEST_TOKEN", prefix = "Bearer " }
X-Api-Key = "lit3ral"
X-Team = "t"
[load.body]
model = "m"
messages = [{ role = "user", content = "$prompt" }]
max_tokens = "$max_tokens"
stream = true
[steady_state]
ttft_p99 = "<= 300ms"
itl_p95 = "<= 50ms"
output_tokens_per_s = ">= 10"
goodput = { share = ">= 90%", ttft = "<= 200ms", itl = "<= 60ms", e2e = "<= 1s" }
""",
    )
    L = e.load
    assert L is not None and L.method == "POST" and L.stream
    assert L.endpoint("http://other:1") == "http://127.0.0.1:9/v1/chat/completions"
    body = json.loads(corpora.request_body(L, "hi there"))
    assert body["messages"] == [{"role": "user", "content": "hi there"}]
    assert body["max_tokens"] == L.max_tokens and body["stream"] is True
    names = [n for n, _a, _b in e.steady.terms()]
    assert names == ["ttft_p99", "itl_p95", "output_tokens_per_s", "goodput"]
    assert e.steady.good is not None and str(e.steady.good).startswith("ttft <= 200ms")
    # The secret is read when the run starts, from the environment, and
    # literal secret-looking values are not kept in what is stored.
    monkeypatch.delenv("GF_TEST_TOKEN", raising=False)
    with pytest.raises(ExperimentError, match="GF_TEST_TOKEN is not set: export"):
        L.resolved_headers("s.toml")
    monkeypatch.setenv("GF_TEST_TOKEN", "tok-123")
    assert L.resolved_headers("s.toml") == {
        "Authorization": "Bearer tok-123",
        "X-Api-Key": "lit3ral",
        "X-Team": "t",
    }
    stored = json.dumps(e.expanded)
    assert "lit3ral" not in stored and "tok-123" not in stored and "GF_TEST_TOKEN" in stored
    assert e.expanded["load"]["headers"]["X-Team"] == "t"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[load]\nstreem = true\n", "load.streem: unknown key: remove it or use one of arrival, "),
        ('[load]\nmethod = "TRACE"\n', "use one of POST, GET, PUT, PATCH"),
        ('[load]\nurl = "ftp://x/y"\n', "give a full http(s) URL"),
        ('[load]\nurl = "http://x/y"\npath = "/v1"\n', "either url"),
        ('[load]\nbody = { prompt = "hi" }\n', 'no "$prompt" in it'),
        ('[load]\nmethod = "GET"\nbody = { p = "$prompt" }\n', "a GET sends no body"),
        ('[load]\nheaders = { Host = "x" }\n', "sets this header itself"),
        ('[load]\nheaders = { A = { env = "1X" } }\n', "not an environment variable name"),
        ('[load]\nheaders = { A = { var = "X" } }\n', "load.headers.A.var: unknown key"),
        ('[load]\n[steady_state]\nitl_p99 = "<= 20ms"\n', "add stream = true to [load]"),
        (
            '[load]\nstream = true\n[steady_state]\ngoodput = ">= 90%"\n',
            "expected a table { share",
        ),
        (
            '[load]\nstream = true\n[steady_state]\ngoodput = { share = ">= 90%" }\n',
            "at least one per-request bound",
        ),
        ('[load]\nstream = true\n[steady_state]\nttft_p99 = ">= lots"\n', "steady_state.ttft_p99"),
    ],
)
def test_bad_load_and_slo_keys_are_one_line(tmp_path: Path, text: str, words: str) -> None:
    msg = refusal(tmp_path, text)
    assert words in msg and str(tmp_path / "s.toml") in msg, msg


def test_the_shipped_streaming_file_validates() -> None:
    e = F.load("stream-itl-stall")
    assert e.load is not None and e.load.stream
    assert {n for n, _a, _b in e.steady.terms()} >= {"itl_p99", "p99", "ttft_p99"}
    assert e.expect.verdict == "fail"


# ---- end to end, as root: a decode stall breaks ITL, a loose e2e bound holds ----------------


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="requires root (BPF, ptrace)")
@pytest.mark.skipif(not paths.DOUBLE_LIBCUDA.exists(), reason="run `make build` (libcuda double)")
def test_decode_stall_breaks_itl_not_e2e_and_no_secret_is_stored(tmp_path: Path) -> None:
    text = F.find("stream-itl-stall").read_text()
    assert "stream = true\n" in text
    text = text.replace(
        "stream = true\n",
        "stream = true\n"
        'headers = { Authorization = { env = "GF_STREAM_TOKEN", prefix = "Bearer " } }\n',
        1,
    )
    # Goodput: a request with a stalled gap is not good.
    assert 'quorum = "60%"\n' in text
    text = text.replace(
        'quorum = "60%"\n',
        'quorum = "60%"\ngoodput = { share = ">= 90%", ttft = "<= 2s", itl = "<= 30ms" }\n',
        1,
    )
    f = tmp_path / "stream-itl-stall.toml"
    f.write_text(text)
    db = tmp_path / "gf.db"
    secret = "sk-test-" + os.urandom(6).hex()
    t = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "pyctl", "experiment", "run", str(f), "--db", str(db), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GF_STREAM_TOKEN": secret},
    )
    took = time.monotonic() - t
    out = p.stdout + p.stderr
    assert p.returncode == 0, out  # the file expects its fail
    doc = json.loads(p.stdout)
    assert doc["verdict"] == "fail" and "load.itl_p99" in doc["reason"], doc["reason"]
    slo = {(x["term"], x["phase"]): x for x in doc["slo"]}
    assert not slo[("load.itl_p99", "during")]["ok"] and slo[("load.p99", "during")]["ok"]
    assert slo[("load.itl_p99", "during")]["value"] > 0.030
    c = sqlite3.connect(db)
    try:
        rows = {
            (ph, name): bool(ok)
            for ph, name, ok in c.execute("SELECT phase, probe, ok FROM hypothesis_results")
        }
    finally:
        c.close()
    assert rows[("before", "load.itl_p99")] and not rows[("during", "load.itl_p99")], rows
    assert rows[("during", "load.p99")] and rows[("during", "load.error_rate")], rows
    assert rows[("after", "load.itl_p99")], rows
    assert rows[("before", "load.goodput")] and not rows[("during", "load.goodput")], rows
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert secret not in out
    print(f"stream-itl-stall: {took:.1f}s")


def test_a_missing_header_variable_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    text = (
        F.find("control")
        .read_text()
        .replace(
            'timeout = "2s"\n',
            'timeout = "2s"\nheaders = { Authorization = { env = "GF_NOPE_T" } }\n',
            1,
        )
    )
    f = tmp_path / "control.toml"
    f.write_text(text)
    db = tmp_path / "sub" / "gf.db"
    db.parent.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "GF_NOPE_T"}
    t = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "pyctl", "experiment", "run", str(f), "--db", str(db)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    took = time.monotonic() - t
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
    assert "load.headers.Authorization: the environment variable GF_NOPE_T is not set" in p.stderr
    assert list(db.parent.iterdir()) == []  # no database, nothing else
    assert took < 5, took  # refused before the service started


def test_tgi_and_chat_answers_are_read_too() -> None:
    p = _SSE()
    p.feed(b'data:{"token": {"id": 1, "text": "He", "special": false}}\n\n', 1.0)
    p.feed(b'data:{"token": {"id": 2, "text": "llo", "special": false}}\n\n', 1.5)
    p.feed(b'data:{"token": {"id": 0, "text": "</s>", "special": true}, ', 2.0)
    p.feed(b'"generated_text": "Hello"}\n\n', 2.0)
    assert p.token_at == [1.0, 1.5] and "".join(p.texts) == "Hello" and p.done
    assert answer_text("application/json", b'[{"generated_text": "hi"}]') == "hi"
    chat = b'{"choices": [{"message": {"role": "assistant", "content": "yo"}}]}'
    assert answer_text("application/json; charset=utf-8", chat) == "yo"
    evs = b'data: {"choices": [{"delta": {"content": "a"}}]}\n\ndata: [DONE]\n\n'
    assert answer_text("text/event-stream", evs) == "a"
    assert answer_text("application/json", b"not json") == ""


def test_the_official_openai_client_reads_the_services_streams(service: ServiceProc) -> None:
    """The peer: OpenAI's own Python client parses the completion and chat
    streams and answers (its SSE decoder, its models)."""
    openai = pytest.importorskip("openai", reason="pip install openai (the peer client)")
    client = openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)
    plain = client.completions.create(model="gf", prompt="hello world", max_tokens=5)
    chunks = list(
        client.completions.create(
            model="gf",
            prompt="hello world",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="gf", messages=msgs, max_tokens=4)
    assert chat.choices[0].message.role == "assistant"
    deltas = list(
        client.chat.completions.create(model="gf", messages=msgs, max_tokens=4, stream=True)
    )
    assert deltas[0].choices[0].delta.role == "assistant"
    assert deltas[-1].choices[0].finish_reason == "length"
    text = "".join(d.choices[0].delta.content or "" for d in deltas)
    assert text == chat.choices[0].message.content
