"""A user's prompt set, `[load] prompts = "file.jsonl"` (pyctl/experiment/
promptset.py): the lines' shapes, the bodies they make, the root-safe open
(no symlink, regular files only, a size limit) and one-line refusals with
line numbers, at `experiment validate` time."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from expfile import header

from pyctl.cli.experiment import experiment
from pyctl.experiment import corpora
from pyctl.experiment import load as F
from pyctl.experiment.model import ExperimentError
from pyctl.experiment.promptset import PromptSetError, read_prompt_set

LINES = [
    {"prompt": "ka tu ro", "max_tokens": 3, "reference": " sa sa sa"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]},
    {"prompt": "mi sa"},
]


def _jsonl(path: Path, rows: list[object], tail: str = "\n") -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + tail)
    return path


def test_lines_prompt_messages_max_tokens_reference(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "p.jsonl", LINES, tail="\n\n")  # blank lines are skipped
    ps = read_prompt_set(p)
    a, b, c = ps.entries
    assert (a.prompt, a.max_tokens, a.reference) == ("ka tu ro", 3, " sa sa sa")
    assert b.messages == (("system", "Be brief."), ("user", "hi")) and b.text == "hi"
    assert c.chat() == [{"role": "user", "content": "mi sa"}]
    assert ps.has_messages and len(ps.sha256) == 64


BAD = [
    ("{not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    ('{"prompt": "a", "max_token": 3}', "line 2: unknown key 'max_token'"),
    ('{"prompt": "a", "messages": []}', 'line 2: give "prompt" (a string) or "messages"'),
    ("{}", 'line 2: give "prompt"'),
    ('{"prompt": 3}', 'line 2: "prompt": expected a string'),
    ('{"messages": [{"role": "robot", "content": "x"}]}', 'line 2: "messages"[1]: expected'),
    ('{"messages": []}', 'line 2: "messages": expected a non-empty list'),
    ('{"prompt": "a", "max_tokens": 0}', 'line 2: "max_tokens": 0: give an integer >= 1'),
    ('{"prompt": "a", "max_tokens": true}', 'line 2: "max_tokens": True'),
    ('{"prompt": "a", "reference": 1}', 'line 2: "reference": expected a string'),
]


@pytest.mark.parametrize(("line", "words"), BAD)
def test_a_bad_line_is_one_line_with_its_number(tmp_path: Path, line: str, words: str) -> None:
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "fine"}\n' + line + '\n{"prompt": "also fine"}\n')
    with pytest.raises(PromptSetError) as ei:
        read_prompt_set(p)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{p}: ") and words in msg, msg


def test_not_utf8_and_empty_files(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    p.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(PromptSetError, match="line 2: not UTF-8"):
        read_prompt_set(p)
    p.write_text("\n\n")
    with pytest.raises(PromptSetError, match="no prompts in it"):
        read_prompt_set(p)


def test_symlinks_fifos_directories_missing_and_large_files_are_refused(tmp_path: Path) -> None:
    real = _jsonl(tmp_path / "real.jsonl", LINES)
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    with pytest.raises(PromptSetError, match="is a symbolic link: name the file itself"):
        read_prompt_set(link)
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # no writer: a blocking open would hang here
    with pytest.raises(PromptSetError, match="not a regular file"):
        read_prompt_set(fifo)
    with pytest.raises(PromptSetError, match="not a regular file"):
        read_prompt_set(tmp_path)
    with pytest.raises(PromptSetError, match=r"cannot open it \(No such file"):
        read_prompt_set(tmp_path / "none.jsonl")
    size = real.stat().st_size
    with pytest.raises(PromptSetError, match=f"{size} bytes, over the 10 byte limit"):
        read_prompt_set(real, max_bytes=10)
    assert len(read_prompt_set(real, max_bytes=size).entries) == 3


# ---- in an experiment file ----------------------------------------------------------------

BASE = header("p")

CHAT = """
[load]
url = "http://127.0.0.1:9/v1/chat/completions"
prompts = "set/p.jsonl"
max_tokens = 8
body = { model = "m", messages = "$messages", max_tokens = "$max_tokens" }
"""


def _file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "p.toml"
    p.write_text(BASE + text)
    return p


def test_prompt_file_next_to_the_experiment_makes_the_bodies(tmp_path: Path) -> None:
    (tmp_path / "set").mkdir()
    _jsonl(tmp_path / "set" / "p.jsonl", LINES)
    # relative to the experiment file's directory, not to the current one
    e = F.load_file(_file(tmp_path, CHAT))
    L = e.load
    assert L is not None and L.prompt_set is not None and L.corpus == "prompts"
    cases = corpora.cases(L, 10)
    assert cases is not None and [n for n, _b in cases] == ["line 1", "line 2", "line 3"]
    bodies = [json.loads(b) for _n, b in cases]
    assert bodies[0] == {
        "model": "m",
        "messages": [{"role": "user", "content": "ka tu ro"}],
        "max_tokens": 3,  # the line's own
    }
    assert bodies[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert bodies[2]["max_tokens"] == 8  # [load]'s
    assert "3 prompts of" in corpora.describe(L)
    info = e.expanded["load"]["prompts_file"]
    assert info["entries"] == 3 and len(info["sha256"]) == 64
    assert info["path"].endswith("set/p.jsonl")


def test_a_completion_body_gets_the_prompt_text(tmp_path: Path) -> None:
    _jsonl(tmp_path / "p.jsonl", [{"prompt": "a b", "max_tokens": 2}, {"prompt": "c"}])
    e = F.load_file(_file(tmp_path, '[load]\nprompts = "p.jsonl"\nmax_tokens = 5\n'))
    assert e.load is not None
    got = [json.loads(b) for b in corpora.bodies(e.load, 1) or []]
    assert [(b["prompt"], b["max_tokens"]) for b in got] == [("a b", 2), ("c", 5)]


def test_chat_lines_without_a_messages_body_are_refused(tmp_path: Path) -> None:
    (tmp_path / "set").mkdir()
    _jsonl(tmp_path / "set" / "p.jsonl", LINES)
    with pytest.raises(ExperimentError) as ei:
        F.load_file(_file(tmp_path, '[load]\nprompts = "set/p.jsonl"\n'))
    msg = str(ei.value)
    assert "\n" not in msg and "load.prompts" in msg and "entry 2 has chat messages" in msg


def test_validate_refuses_a_bad_line_in_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b",}\n')
    p = _file(tmp_path, CHAT)
    r = CliRunner().invoke(experiment, ["validate", str(p)])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert f"{p}: load.prompts: " in lines[0] and "p.jsonl: line 2: not JSON" in lines[0]
    link = tmp_path / "set" / "l.jsonl"
    link.symlink_to(tmp_path / "set" / "p.jsonl")
    p.write_text(BASE + CHAT.replace("set/p.jsonl", "set/l.jsonl"))
    r = CliRunner().invoke(experiment, ["validate", str(p)])
    assert r.exit_code == 2 and "is a symbolic link" in r.output, r.output
    # a good set validates
    _jsonl(tmp_path / "set" / "p.jsonl", LINES)
    p.write_text(BASE + CHAT)
    r = CliRunner().invoke(experiment, ["validate", str(p)])
    assert r.exit_code == 0, r.output


def test_a_traffic_step_takes_a_prompt_file_too(tmp_path: Path) -> None:
    _jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}, {"prompt": "y"}])
    text = """
[[method]]
traffic = { prompts = "p.jsonl", rate = 5, arrival = { kind = "poisson", seed = 3 } }
duration = "1s"
"""
    e = F.load_file(_file(tmp_path, text))
    t = e.steps[0].traffic
    assert t is not None and t.prompt_set is not None and len(t.prompt_set.entries) == 2
    assert t.plan().kind == "poisson" and t.plan().seed == 3
    # a traffic step's drawn seed is stored too, in its own table
    e = F.load_file(_file(tmp_path, text.replace(", seed = 3", "")))
    t = e.steps[0].traffic
    assert t is not None and t.arrival is not None and t.arrival.drawn
    stored = e.expanded["method"][0]["traffic"]
    assert stored["arrival"] == {"kind": "poisson", "seed": t.arrival.seed}
    r = CliRunner().invoke(experiment, ["show", str(tmp_path / "p.toml")])
    # show reads the file anew: a seed of its own, said to be drawn
    assert r.exit_code == 0 and "poisson 5/s open loop (seed " in r.output, r.output
    assert ", drawn), 2 prompts of " in r.output, r.output


def test_quality_cases_from_a_jsonl_file(tmp_path: Path) -> None:
    _jsonl(tmp_path / "refs.jsonl", [{"prompt": "ka tu", "reference": " sa"}, {"prompt": "mi"}])
    q = '[load]\n[quality]\nmetric = "exact"\nexact_drop_pct = "<= 5"\ncases = "refs.jsonl"\n'
    e = F.load_file(_file(tmp_path, q))
    assert e.quality is not None and e.quality.cases == [("ka tu", " sa"), ("mi", None)]
    # A chat line is a chat case: sent as the [load] chat body's "$messages"
    _jsonl(tmp_path / "refs.jsonl", [{"prompt": "a"}, {"messages": LINES[1]["messages"]}])
    with pytest.raises(ExperimentError) as ei:
        F.load_file(_file(tmp_path, q))  # ... which a completions [load] has not
    msg = str(ei.value)
    assert "\n" not in msg and "quality.cases[2]" in msg and "give [load] a chat body" in msg
    chat_load = (
        '[load]\nurl = "http://127.0.0.1:9/v1/chat/completions"\n'
        'body = { messages = "$messages", max_tokens = "$max_tokens" }\n'
    )
    e = F.load_file(_file(tmp_path, q.replace("[load]\n", chat_load)))
    assert e.quality is not None and e.quality.chats == [None, LINES[1]["messages"]]
    users = [m["content"] for m in LINES[1]["messages"] if m["role"] == "user"]
    assert e.quality.cases[1] == (users[-1], None)
    _jsonl(tmp_path / "refs.jsonl", [{"prompt": "a", "max_tokens": 3}])
    with pytest.raises(ExperimentError, match="entry 1 has its own max_tokens"):
        F.load_file(_file(tmp_path, q))
    (tmp_path / "refs.jsonl").write_text('{"prompt": "a", "referense": "b"}\n')
    with pytest.raises(ExperimentError, match="refs.jsonl: line 1: unknown key 'referense'"):
        F.load_file(_file(tmp_path, q))
