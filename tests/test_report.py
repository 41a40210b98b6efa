"""The experiment report (pyctl/report/) from a synthetic evidence database:
what the HTML and Markdown hold, that the HTML fetches nothing, the CLI."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner
from observe_db import T0, add_experiment, make_db

from pyctl.cli.report import report
from pyctl.report import ReportError, render_html, render_markdown


@pytest.fixture
def db(tmp_path: Path):
    d = make_db(tmp_path / "gf.db")
    add_experiment(d, "e1", name="tokenizer-stall")
    add_experiment(
        d,
        "e2",
        name="cuda-oom-under-load",
        t0=T0 + 100,
        run_id="5e6f7a8b",
        verdict="pass",
        stall_ms=400,
        xid=False,
        alert=None,
        recovered=1.2,
    )
    add_experiment(
        d,
        "e3",
        name="worker-hang-abort",
        t0=T0 + 200,
        run_id="99aa88bb",
        verdict="aborted",
        stall_ms=4000,
        xid=False,
        alert=False,
        degraded=False,
        recovered=None,
    )
    yield d
    d.close()


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def test_html_is_self_contained(db) -> None:
    h = render_html(db, ["e1", "e2", "e3"])
    p = Tags()
    p.feed(h)
    names = {t for t, _a in p.tags}
    assert "script" not in names and "img" not in names and "link" not in names
    for _t, a in p.tags:
        for k in ("src", "href"):
            v = a.get(k)
            assert v is None or v.startswith("#"), (k, v)  # in-page links only
    assert "url(" not in h and "@import" not in h
    # The SVG namespace is a name, never fetched.
    assert re.findall(r"https?://[^\s\"'<]+", h) == ["http://www.w3.org/2000/svg"] * 3


def test_html_content(db) -> None:
    h = render_html(db, ["e1", "e2", "e3"])
    assert h.count('<svg xmlns="http://www.w3.org/2000/svg" class="timeline"') == 3
    # Matrix: one row per experiment, three expectation cells each.
    m = re.search(r'<table class="matrix">.*?</table>', h, re.S)
    assert m
    cells = re.findall(r'data-expectation="(\w+)"[^>]*>([^<]*)<', m.group(0))
    assert len(cells) == 9
    assert cells[0] == ("alert_fired", "✓ after 4.20 s")
    assert cells[2] == ("recovered_within", "✓ 3.00 s (N = 30 s)")
    assert cells[3] == ("alert_fired", "– not asserted")
    assert cells[6] == ("alert_fired", "✗ no")
    assert cells[8] == ("recovered_within", "✗ never (N = 30 s)")
    # The timeline marks: fault windows, each fault ID, the Xid, the anchor.
    assert h.count('class="fault-window"') == 3
    for k in range(1, 7):
        assert f'data-fault-id="1a2b3c4d-{k}"' in h
    assert 'class="xid-marker"' in h and ">Xid 31<" in h
    assert 'class="anchor-marker"' in h and "anchor reset_begin" in h
    assert "recovered +3.0 s" in h and "recovered +1.2 s" in h
    assert 'class="line-p50"' in h and 'class="line-p99"' in h
    # Hypothesis before/during/after, the statistics, the chains.
    assert "✗ 82 ms" in h and "1.2e-05" in h and "Mann-Whitney U" in h
    assert "Xid 31 on 0000:18:00.0: MMU Fault: ENGINE GRAPHICS" in h
    assert "tokenizers.abi3.so!encode_char_offsets" in h  # the full chain's stack
    assert "tighten-breaker.sh" in h
    # A hang's latency spans decades: a log axis.
    assert "latency (log)" in h


def test_markdown(db) -> None:
    md = render_markdown(db, ["e1", "e3"])
    assert md.startswith("# gpufault experiment report: tokenizer-stall, worker-hang-abort\n")
    assert (
        # rate 50 is not the shipped tokenizer-stall's default (30): its --set is shown
        "| tokenizer-stall (`e1`) `set rate=50` | chat-p99 | ✓ after 4.20 s | "
        "✓ yes (87 % of samples) | "
        "✓ 3.00 s (N = 30 s) | **fail** |" in md
    )
    assert "| worker-hang-abort (`e3`) | chat-p99 | ✗ no |" in md
    assert "| p99-latency | < 100 ms | ✓ 32 ms | ✗ 82 ms | ✓ 33 ms |" in md
    assert "| fault | +10.00 s .. +25.00 s |" in md
    assert "`1a2b3c4d-3` | tok:hf-encode | stall | stall |" in md
    assert "Xid 31 on 0000:18:00.0" in md


def test_unknown_experiment(db) -> None:
    with pytest.raises(ReportError, match="experiment nope: not in this database"):
        render_html(db, ["nope"])


def test_cli(tmp_path: Path, db) -> None:
    out, md = tmp_path / "r.html", tmp_path / "r.md"
    r = CliRunner().invoke(
        report, ["e1", "e2", "-o", str(out), "--markdown", str(md), "--db", str(tmp_path / "gf.db")]
    )
    assert r.exit_code == 0, r.output
    assert "report of 2 experiment(s) (tokenizer-stall fail, cuda-oom-under-load pass)" in r.output
    assert out.read_text().startswith("<!DOCTYPE html>") and md.read_text().startswith("# ")
    assert not list(tmp_path.glob("*.tmp"))
    r = CliRunner().invoke(report, ["nope", "-o", str(out), "--db", str(tmp_path / "gf.db")])
    assert r.exit_code != 0 and isinstance(r.exception, ReportError)
    r = CliRunner().invoke(
        report, ["e1", "-o", str(tmp_path / "no" / "r.html"), "--db", str(tmp_path / "gf.db")]
    )
    assert isinstance(r.exception, ReportError) and "no such directory" in str(r.exception)


def test_experiment_without_load_or_faults(tmp_path: Path) -> None:
    """A control experiment: no step, no load windows, no expectation."""
    d = make_db(tmp_path / "gf.db")
    d.conn.execute(
        "INSERT INTO experiments (id, name, version, slo_id, started_at, ended_at,"
        " verdict) VALUES ('c', 'control', 1, 's', ?, ?, 'pass')",
        (T0, T0 + 5),
    )
    d.conn.commit()
    h = render_html(d, ["c"])
    assert 'class="timeline"' in h and "no fault fired" in h
    assert h.count("– not asserted") == 3
    assert "control" in render_markdown(d, ["c"])
