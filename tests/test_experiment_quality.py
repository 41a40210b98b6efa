"""[quality] (issue 23): BLEU-4 / exact-match scoring, the file's keys, the
probe against the real reference service, and, as root, the handbook's
"BLEU-4 drop <= 5 % and latency P99 <= 800 ms" example: bit flips make the
quality half fail where latency alone passes, and the lowest mantissa bit
(no change to a greedy answer) makes the same file pass.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from expfile import header
from service_proc import ServiceProc

from pyctl.experiment import load as F
from pyctl.experiment import quality as Q
from pyctl.experiment.model import ExperimentError

REPO = Path(__file__).resolve().parent.parent


def test_bleu_and_exact_scores_and_the_drop() -> None:
    refs = [" sa sa sa sa sa sa sa sa", " ri ri ri ri ri ri ri ri"]
    assert Q.score("bleu", refs, refs) == pytest.approx(100.0)
    garbled = [" sa sa sa sa ka ka ka ka", " ri ri ri ri ri ri ri ri"]
    b = Q.score("bleu", garbled, refs)
    assert 0 < b < 100
    # The peer: sacrebleu's own corpus BLEU of the same pairs.
    import sacrebleu

    assert b == pytest.approx(sacrebleu.corpus_bleu(garbled, [refs]).score)
    assert Q.score("exact", garbled, refs) == 50.0
    assert Q.score("exact", ["  x "], ["x"]) == 100.0
    assert math.isnan(Q.score("bleu", [], []))
    assert Q.drop_pct(100.0, 95.0) == pytest.approx(5.0)
    assert Q.drop_pct(80.0, 90.0) == 0.0  # better is no drop
    assert math.isnan(Q.drop_pct(0.0, 10.0))  # nothing to drop from


BASE = header("q")


def qfile(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "q.toml"
    p.write_text(BASE + text)
    return p


def test_quality_keys_parse(tmp_path: Path) -> None:
    e = F.load_file(
        qfile(
            tmp_path,
            """
[quality]
metric = "exact"
exact_drop_pct = "<= 10"
interval = "250ms"
cases = [{ prompt = "a", reference = "b" }, { prompt = "c" }]
""",
        )
    )
    q = e.quality
    assert q is not None and q.metric == "exact" and q.interval == 0.25
    assert q.cases == [("a", "b"), ("c", None)] and q.term == "quality.exact_drop_pct"
    assert q.bound.check(10) and not q.bound.check(10.5)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[quality]\nmetric = "rouge"\n', "use one of bleu, exact"),
        ('[quality]\nbleu_drop_pct = "<= 5"\n', "quality.cases: expected a list"),
        ('[quality]\ncases = [{ prompt = "a" }]\n', "quality.bleu_drop_pct: missing"),
        (
            '[quality]\nmetric = "exact"\nbleu_drop_pct = "<= 5"\ncases = [{ prompt = "a" }]\n',
            "bound exact_drop_pct instead",
        ),
        (
            '[quality]\nbleu_drop_pct = "<= 5"\ncases = [{ prompt = "a", ref = "b" }]\n',
            "quality.cases[1].ref: unknown key",
        ),
        ('[quality]\nbleu_drop_pct = "<= 5"\ncases = [{ prompt = "a" }]\nn = 1\n', "quality.n"),
        (
            '[quality]\nbleu_drop_pct = "<= 5"\ncases = [{ prompt = "a", messages = [] }]\n',
            "quality.cases[1]: give prompt",
        ),
        (
            '[quality]\nbleu_drop_pct = "<= 5"\ncases = [{ messages = [{ role = "x", '
            'content = "a" }] }]\n',
            "quality.cases[1].messages[1]: expected",
        ),
        (
            '[quality]\nbleu_drop_pct = "<= 5"\ncases = [{ messages = [{ role = "user", '
            'content = "a" }] }]\n',
            "quality.cases[1]: a chat case is sent as the [load]'s",
        ),
    ],
)
def test_bad_quality_tables_are_one_line(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ExperimentError) as ei:
        F.load_file(qfile(tmp_path, text))
    msg = str(ei.value)
    assert "\n" not in msg and words in msg, msg


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ka tu ro"}]


def _chat_quality_file(d: Path, url: str) -> Path:
    """A file whose [load] and [quality] both speak chat completions."""
    p = d / "chat.toml"
    p.write_text(
        BASE.replace("http://127.0.0.1:9", url)
        + f'[load]\nurl = "{url}/v1/chat/completions"\n'
        + """body = { messages = "$messages", max_tokens = "$max_tokens" }
[quality]
metric = "exact"
exact_drop_pct = "<= 5"
cases = [
  { messages = [
    { role = "system", content = "Be brief." },
    { role = "user", content = "ka tu ro" },
  ] },
  { messages = [{ role = "user", content = "mi" }] },
]
"""
    )
    return p


def test_the_probe_reads_plain_streamed_and_chat_answers_of_the_service(tmp_path: Path) -> None:
    s = ServiceProc("--batch-wait", "0")
    try:
        e = F.load("quality-bleu-bitflip")
        assert e.quality is not None
        q = e.quality
        plain = Q.QualityProbe.build(q, s.url, e.load, {})
        rnd = plain.one_round()
        assert rnd.errors == 0 and rnd.texts[:5] == [ref for _p, ref in q.cases[:5]], rnd
        L = F.Load(1, "", 8, 3.0, "/v1/chat/completions", 1, stream=True)
        L.body = {"messages": [{"role": "user", "content": "$prompt"}], "stream": True}
        L.body["max_tokens"] = "$max_tokens"
        chat = Q.QualityProbe.build(q, s.url, L, {}).one_round()
        assert chat.errors == 0 and all(len(t) > 0 for t in chat.texts), chat
        # Chat cases: each sent as the body's "$messages", read back as text
        L.body = {"messages": "$messages", "max_tokens": "$max_tokens", "stream": True}
        qc = F.load_file(_chat_quality_file(tmp_path, s.url))
        assert qc.quality is not None and qc.load is not None
        sent: list[bytes] = Q.QualityProbe.build(qc.quality, s.url, qc.load, {}).bodies
        mi = [{"role": "user", "content": "mi"}]
        assert [json.loads(b)["messages"] for b in sent] == [CHAT, mi]
        crnd = Q.QualityProbe.build(qc.quality, s.url, qc.load, {}).one_round()
        assert crnd.errors == 0 and all(len(t) > 0 for t in crnd.texts), crnd
        # In rounds until told to stop (an event, not a sleep).
        done = threading.Event()
        th = plain.start(done)
        while len(plain.rounds()) < 2:
            th.join(0.05)
        done.set()
        th.join(10)
        assert not th.is_alive() and len(plain.rounds()) >= 2
    finally:
        s.close()


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="requires root (the experiment runner's store)")
def test_bitflips_fail_the_quality_half_where_latency_passes(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"

    def run(*sets: str) -> tuple[dict, dict]:
        p = subprocess.run(
            [sys.executable, "-m", "pyctl", "experiment", "run", "quality-bleu-bitflip"]
            + [a for kv in sets for a in ("--set", kv)]
            + ["--db", str(db), "--json"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        doc = json.loads(p.stdout)
        c = sqlite3.connect(db)
        try:
            rows = {
                (ph, n): (bool(ok), v)
                for ph, n, ok, v in c.execute(
                    "SELECT phase, probe, ok, value FROM hypothesis_results "
                    "WHERE experiment_id = ?",
                    (doc["experiment_id"],),
                )
            }
        finally:
            c.close()
        return doc, rows

    doc, rows = run()
    assert doc["verdict"] == "fail" and "quality.bleu_drop_pct" in doc["reason"], doc
    slo = {(x["term"], x["phase"]): x for x in doc["slo"]}
    assert slo[("quality.bleu", "before")]["value"] > 0
    assert not slo[("quality.bleu_drop_pct", "during")]["ok"]
    assert rows[("before", "quality.bleu")][0]
    assert not rows[("during", "quality.bleu_drop_pct")][0]
    assert float(rows[("during", "quality.bleu_drop_pct")][1]) > 50
    # The latency half alone would have passed.
    assert rows[("during", "load.p99")][0] and rows[("during", "load.error_rate")][0]
    assert rows[("after", "quality.bleu_drop_pct")][0]
    # The lowest mantissa bit leaves greedy answers as they were: a pass.
    doc, rows = run("bits=mant:0")
    assert doc["verdict"] == "pass", doc
    assert rows[("during", "quality.bleu_drop_pct")][0]
