"""The experiment report (pyctl/report/) from a synthetic evidence database:
what the HTML and Markdown hold, that the HTML fetches nothing, the CLI."""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

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


def test_slo_bounds_breaches_arming_and_step_numbers(tmp_path: Path) -> None:
    """The file's bounds drawn and listed, each window over one marked,
    the fault phase from the step's real start (2 s after its planned one:
    "arming" before it), and steps numbered from 1 as the CLI does."""
    d = make_db(tmp_path / "gf.db")
    add_experiment(d, "e1", name="tokenizer-stall", steady={"p99": "<= 100ms",
                   "error_rate": "<= 1%"}, errors=True, armed_after=2.0)  # fmt: skip
    h = render_html(d, ["e1"])
    assert h.count('class="slo-bound slo-p99"') == 1 and "p99 SLO 100 ms" in h
    assert 'class="slo-bound slo-error_rate"' in h
    breaches = [html.unescape(b) for b in re.findall(
        r'<rect class="breach"[^>]*><title>([^<]*)</title>', h)]  # fmt: skip
    p99s = [w for w in load_windows(d) if w["p99"] > 0.1 or w["error_rate"] > 0.01]
    assert len(breaches) == len(p99s) > 0, (breaches, len(p99s))
    assert any("p99" in b and "> 100 ms" in b for b in breaches)
    assert any("errors 8.0 % > 1 %" in b for b in breaches)
    phases = re.findall(r'<rect class="phase"[^>]*><title>(\w+) ([\d.]+)-([\d.]+) s', h)
    (arming,) = [p for p in phases if p[0] == "arming"]
    (fault,) = [p for p in phases if p[0] == "fault"]
    assert (float(arming[1]), float(arming[2])) == (10.0, 12.0) and float(fault[1]) == 12.0
    assert ">1 stall-encode</text>" in h and "<td class=\"num\">1</td>" in h
    md = render_markdown(d, ["e1"])
    assert f"- SLO per 1 s window: p99 <= 100 ms, errors <= 1 %; {len(p99s)} of 40 windows" in md
    assert "| 1 | stall-encode |" in md
    # Without bounds in the file: no line, no marks.
    d2 = make_db(tmp_path / "gf2.db")
    add_experiment(d2, "e2", name="tokenizer-stall")
    h2 = render_html(d2, ["e2"])
    assert "slo-bound" not in h2 and 'class="breach"' not in h2 and ">arming<" not in h2


def load_windows(d: Any) -> list[dict[str, Any]]:
    cur = d.conn.execute("SELECT p99, error_rate FROM load_windows ORDER BY start")
    return [{"p99": a, "error_rate": b} for a, b in cur.fetchall()]
