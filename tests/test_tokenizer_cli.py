"""`gpufault tokenizer ...` end to end: real tokenizers, a real SQLite
store, a real local HTTP endpoint (stdlib server on 127.0.0.1)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import sqlite_utils
from click.testing import CliRunner

from pyctl.cli.tokenizer import tokenizer
from pyctl.tokenizer.builders import build_tiktoken

pytest.importorskip("tiktoken", reason="needs the tiktoken wheel")


def run(args: list[str]) -> tuple[int, str]:
    r = CliRunner().invoke(tokenizer, args, catch_exceptions=False)
    return r.exit_code, r.output


def rows(db: Path, campaign: str) -> list[dict]:
    return list(
        sqlite_utils.Database(db).query(
            "select * from tok_cases where campaign = ? order by seq", [campaign]
        )
    )


def test_every_command_has_help() -> None:
    for name, cmd in tokenizer.commands.items():
        assert cmd.help and cmd.help.strip(), name
        code, out = run([name, "--help"])
        assert code == 0 and "Example" in out, name


def test_fuzz_stores_redacted_rows(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    code, out = run(["fuzz", "--target", "tiktoken", "--max-len", "2000", "--db", str(db)])
    assert code == 0, out
    assert "0 finding(s)" in out
    got = rows(db, "fuzz")
    assert len(got) > 40
    run_id = got[0]["run_id"]
    assert [r["fault_id"] for r in got] == [f"{run_id}-{i}" for i in range(1, len(got) + 1)]
    assert all(r["text"] is None for r in got)
    one = next(r for r in got if json.loads(r["details"])["case"] == "high-in-word")
    text = "abc\ud83ddef"
    assert one["input_sha256"] == hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    assert one["input_len"] == 7 and one["input_bytes"] == 9
    run_row = sqlite_utils.Database(db)["runs"].get(run_id)
    assert run_row["kind"] == "tokenizer:fuzz" and run_row["status"] == "done"
    assert (db.stat().st_mode & 0o777) == 0o600


def test_fuzz_keep_text(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    code, _ = run(
        [
            "fuzz",
            "--target",
            "tiktoken",
            "--category",
            "mixed_script",
            "--db",
            str(db),
            "--keep-text",
        ]
    )
    assert code == 0
    texts = [r["text"] for r in rows(db, "fuzz")]
    assert "p\u0430yp\u0430l.com" in texts


def test_fuzz_weak_json_and_strict(tmp_path: Path) -> None:
    code, out = run(
        [
            "fuzz",
            "--target",
            "tiktoken",
            "--weaken",
            "--max-len",
            "3000",
            "--category",
            "zero_width_run",
            "--no-db",
            "--json",
            "--strict",
        ]
    )
    assert code == 1
    summary = json.loads(out[out.index("{") :])
    assert {f["outcome"] for f in summary["findings"]} == {"roundtrip-fail"}


def test_race_cli(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    code, out = run(
        [
            "race",
            "--target",
            "tiktoken",
            "--weaken",
            "--stall-us",
            "200",
            "--threads",
            "6",
            "--calls",
            "120",
            "--db",
            str(db),
        ]
    )
    assert code == 0 and "mismatches in" in out
    got = rows(db, "race")
    assert any(r["outcome"] == "mismatch" for r in got)
    code, out = run(
        ["race", "--target", "tiktoken", "--threads", "4", "--calls", "50", "--db", str(db)]
    )
    assert "no mismatches" in out


def test_cache_cli(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    code, out = run(
        ["cache", "--target", "hf", "--cache-capacity", "0", "--requests", "100", "--db", str(db)]
    )
    assert code == 0 and "during/before" in out
    assert [r["kind"] for r in rows(db, "cache")] == ["phase:before", "phase:during", "phase:after"]


def test_truncation_cli_corrupt(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    code, out = run(
        ["truncation", "--target", "hf", "--corrupt", "id-random", "--db", str(db), "--strict"]
    )
    assert code == 1 and "injected" in out
    got = rows(db, "truncation")
    assert any(r["outcome"] == "violation" and json.loads(r["details"])["injected"] for r in got)


@pytest.mark.parametrize(
    "args, words",
    [
        (["fuzz", "--target", "no_such_module:x"], "--target"),
        (["fuzz", "--target", "tiktoken", "--category", "bogus"], "--category"),
        (["race", "--target", "tiktoken", "--threads", "1"], "--threads"),
        (["cache", "--target", "tiktoken", "--cache-capacity", "5"], "--cache-capacity"),
        (["truncation", "--target", "hf", "--max-length", "1"], "--max-length"),
        (["fuzz", "--target", "pid:1"], "probe-only"),
        (["observe", "--pid", "SLEEPER"], "maps no tokenizers"),
        (["observe", "--pid", "999999999"], "--pid"),
    ],
)
def test_bad_input_one_line_error_nothing_left(tmp_path: Path, args: list[str], words: str) -> None:
    db = tmp_path / "gf.db"
    extra = [] if args[0] == "observe" else ["--db", str(db)]
    sleeper = None
    if "SLEEPER" in args:
        # A process of ours that maps no tokenizer library.
        sleeper = subprocess.Popen(["sleep", "60"])
        args = [str(sleeper.pid) if a == "SLEEPER" else a for a in args]
    try:
        r = CliRunner().invoke(tokenizer, args + extra)
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
    assert r.exit_code != 0
    err = [ln for ln in r.output.splitlines() if ln.startswith("Error")]
    assert len(err) == 1 and words in r.output, r.output
    assert not db.exists()


# --- HTTP endpoint ------------------------------------------------------------


def make_server(sound: bool) -> ThreadingHTTPServer:
    enc = build_tiktoken()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            try:
                ids = enc.encode(json.loads(body)["text"])
                code, reply = 200, {"ids": ids}
            except (ValueError, KeyError) as e:  # UnicodeDecodeError is a ValueError
                if not sound:
                    code, reply = 500, {"error": "internal"}  # a sloppy service
                else:
                    code, reply = 400, {"error": str(e)[:80]}
            data = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return ThreadingHTTPServer(("127.0.0.1", 0), H)


@pytest.fixture(params=[True, False], ids=["sound", "sloppy"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    srv = make_server(request.param)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/tokenize", request.param
    finally:
        srv.shutdown()
        srv.server_close()


def test_fuzz_http_endpoint(tmp_path: Path, endpoint: tuple[str, bool]) -> None:
    url, sound = endpoint
    code, out = run(
        [
            "fuzz",
            "--target",
            url,
            "--max-len",
            "2000",
            "--no-db",
            "--json",
            "--category",
            "lone_surrogate",
            "--category",
            "nested_special",
            "--category",
            "mixed_script",
        ]
    )
    assert code == 0
    s = json.loads(out[out.index("{") :])
    # Python's json.loads(bytes) decodes with surrogatepass, so lone
    # surrogates sent as (invalid) UTF-8 get through, and tiktoken replaces them.
    assert s["by_category"]["lone_surrogate"] == {"ok": 4}
    if sound:
        assert s["findings"] == []
        assert s["by_category"]["nested_special"] == {"rejected": 4}  # HTTP 400
    else:
        # special-token text makes the sloppy handler answer 500
        assert {(f["category"], f["outcome"]) for f in s["findings"]} == {
            ("nested_special", "target-error")
        }
