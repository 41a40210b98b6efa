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
from observe_db import T0, add_experiment, add_streaming_and_slo, make_db

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
    # (Two plots per experiment: the timeline and the throughput/token panels.)
    assert re.findall(r"https?://[^\s\"'<]+", h) == ["http://www.w3.org/2000/svg"] * 6


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


def test_throughput_and_token_panels_with_bounds_breaches_and_the_burn(tmp_path: Path) -> None:
    """Schema 8's streamed windows drawn: throughput and output tokens/s,
    TTFT/ITL p50/p99 per window with the file's ttft_p99/itl_p99 bounds as
    dashed lines, each window over one marked on its panel, the burn-rate
    SLO's firing alert as a strip and a table; the Markdown says the same."""
    d = make_db(tmp_path / "gf.db")
    add_experiment(d, "e1", name="tokenizer-stall")
    add_streaming_and_slo(d, "e1")
    h = render_html(d, ["e1"])
    (panels,) = re.findall(r'<svg[^>]*class="load-panels".*?</svg>', h, re.S)
    for cls in ("line-throughput", "line-output-tokens", "line-ttft_p50", "line-ttft_p99",
                "line-itl_p50", "line-itl_p99"):  # fmt: skip
        assert f'class="{cls}"' in panels, cls
    assert 'class="slo-bound slo-itl_p99"' in panels and "itl_p99 SLO 30 ms" in panels
    assert 'class="slo-bound slo-ttft_p99"' in panels and "ttft_p99 SLO 50 ms" in panels
    marks = [html.unescape(b) for b in re.findall(
        r'<rect class="breach"[^>]*><title>([^<]*)</title>', panels)]  # fmt: skip
    # The 15 fault windows: ITL p99 68 ms > 30 ms and TTFT p99 70 ms > 50 ms, nothing else.
    assert len(marks) == 15 and all("itl_p99 68 ms > 30 ms" in m for m in marks), marks
    assert all("ttft_p99 70 ms > 50 ms" in m for m in marks)
    firing = re.findall(r'<rect class="burn-firing"[^>]*><title>([^<]*)</title>', panels)
    assert firing and all("chat-good: 14.4x 12s/1s firing" in f for f in firing)
    assert "<h3>Burn-rate SLOs</h3>" in h and "<td>14.4x 12s/1s</td>" in h
    md = render_markdown(d, ["e1"])
    assert "### Throughput and token latency by phase (medians, worst p99)" in md
    assert "| fault | 40.0/s | 250.0/s | 10.0 ms | 70.0 ms | 4.0 ms | 68.0 ms |" in md, md
    assert ("- token SLO per 1 s window: ttft_p99 <= 50 ms, itl_p99 <= 30 ms; 15 of 40 "
            "windows broke it") in md  # fmt: skip
    (burn,) = [ln for ln in md.splitlines() if ln.startswith("| `chat-good` |")]
    assert "| 14.4x 12s/1s |" in burn and "(fault)" in burn, burn
    # Without streamed columns: the throughput panel only, no token panel or bounds.
    d2 = make_db(tmp_path / "gf2.db")
    add_experiment(d2, "e2", name="tokenizer-stall")
    h2 = render_html(d2, ["e2"])
    assert 'class="line-throughput"' in h2 and "line-itl_p99" not in h2
    md2 = render_markdown(d2, ["e2"])
    assert "Burn-rate SLOs" not in h2 and "Burn-rate SLOs" not in md2
    assert "| phase | answers | output tokens |\n" in md2 and "TTFT p50" not in md2


def test_threads_by_the_name_the_target_gave_them(tmp_path: Path) -> None:
    """A step's thread as the target names it (thread_name, read from
    /proc/PID/task/TID/comm when it armed), a fault's thread with the comm
    the probe read; in the HTML and the Markdown."""
    d = make_db(tmp_path / "gf.db")
    add_experiment(d, "e1", name="tokenizer-stall", fires=2)
    with d.conn:
        d.conn.execute("UPDATE experiment_steps SET thread_name = 'gf-worker', spec = "
                       "'{\"tid\": 4251, \"describe\": [\"stall\"]}'")  # fmt: skip
    h = render_html(d, ["e1"])
    assert '<td class="nowrap">gf-worker (tid 4251)</td>' in h, h
    assert "pid 4242 tid 4251 (gf-http)" in h
    # The timeline's fault markers name the thread too.
    assert re.search(r"<title>fault [0-9a-f-]+: tok:hf-encode stall on tid 4251 \(gf-http\) at", h)
    md = render_markdown(d, ["e1"])
    assert "| gf-worker (tid 4251) |" in md and "pid 4242 tid 4251 (gf-http)" in md
    with d.conn:
        d.conn.execute("UPDATE experiment_steps SET thread_name = NULL, spec = '{}'")
    assert '<td class="nowrap">all</td>' in render_html(d, ["e1"])
