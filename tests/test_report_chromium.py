"""The report as a person sees it: rendered by headless Chromium (Debian's
`chromium`), with no network (every host name resolves to nothing).

- --dump-dom of the report itself: the plot's SVG and the matrix survive
  a real browser's parser;
- --dump-dom of a copy with one measuring script appended (the report has
  none): the laid-out boxes of the plot, its lines and the matrix cells are
  real sizes on the page, not zero-sized or off-screen;
- --screenshot: a PNG of the page (kept in the test's tmp_path; the
  session that wrote the renderer looked at one and fixed what looked
  wrong, see docs/observability.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from observe_db import T0, add_experiment, make_db

from pyctl.report import render_html, svg

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (tools/setup-deps.sh)"
)

MEASURE = """<script>
const box = e => { const r = e.getBoundingClientRect(); return [r.width, r.height]; };
const out = {
  svgs: [...document.querySelectorAll('svg.timeline')].map(box),
  p99: [...document.querySelectorAll('polyline.line-p99')].map(e => e.getBBox().width),
  faults: document.querySelectorAll('g.fault-marker').length,
  cells: [...document.querySelectorAll('table.matrix td.cell')].map(
      e => [e.dataset.expectation, e.textContent.trim(), ...box(e)]),
  page: [document.documentElement.scrollWidth, document.documentElement.scrollHeight],
};
const pre = document.createElement('pre'); pre.id = 'measured';
pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
</script></body>"""


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp / "profile"
    profile.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(tmp))  # its caches and crash dumps stay in tmp
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--user-data-dir={profile}",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--window-size=1200,2000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp,
    )


@pytest.fixture
def report_file(tmp_path: Path) -> Path:
    db = make_db(tmp_path / "gf.db")
    add_experiment(db, "e1", name="tokenizer-stall")
    add_experiment(
        db,
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
    out = tmp_path / "report.html"
    out.write_text(render_html(db, ["e1", "e2"]))
    db.close()
    return out


@pytest.mark.slow
def test_rendered_dom_and_screenshot(tmp_path: Path, report_file: Path) -> None:
    r = chromium(tmp_path, "--dump-dom", report_file.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    assert dom.count('<svg xmlns="http://www.w3.org/2000/svg" class="timeline"') == 2
    assert '<table class="matrix">' in dom
    assert len(re.findall(r'<td class="cell (pass|fail|unset)"', dom)) == 6

    measured = tmp_path / "measured.html"
    measured.write_text(report_file.read_text().replace("</body>", MEASURE))
    r = chromium(tmp_path, "--dump-dom", measured.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r'<pre id="measured">(.*?)</pre>', r.stdout, re.S)
    assert m, r.stdout[-2000:]
    got = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert [tuple(round(v) for v in s) for s in got["svgs"]] == [
        (svg.W, svg.PROBE_Y + svg.PROBE_H + 4)
    ] * 2  # one probe row
    assert all(w > 900 for w in got["p99"]), got["p99"]  # the line spans the time axis
    assert got["faults"] == 12
    assert [c[:2] for c in got["cells"]][:3] == [
        ["alert_fired", "✓ after 4.20 s"],
        ["degradation_worked", "✓ yes (87 % of samples)"],
        ["recovered_within", "✓ 3.00 s (N = 30 s)"],
    ]
    assert all(c[2] > 100 and c[3] > 15 for c in got["cells"]), got["cells"]
    assert got["page"][0] <= 1200  # nothing wider than the window: no sideways scrolling

    png = tmp_path / "report.png"
    r = chromium(tmp_path, f"--screenshot={png}", report_file.as_uri())
    assert r.returncode == 0 and png.exists(), r.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (w, h) == (1200, 2000)
    assert len(data) > 60_000  # a blank page compresses to a few kB
