"""`gpufault inject --metrics-addr`: the run's own /metrics, scraped while
it runs, counts exactly the faults the target saw (real BPF, real target)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from gftarget import LIB, REPO, TARGET, Target, on_victim
from procio import finish, start_controller
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.root]

if not TARGET.exists():  # pragma: no cover - the Makefile builds it first
    pytest.skip("build/targets/gf_target missing: run make build", allow_module_level=True)


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_inject_serves_its_fires_while_it_runs(tmp_path: Path) -> None:
    t = Target()
    try:  # an early end fails here: close the target, as the finally below does
        ctl, started = start_controller(
            [
                sys.executable,
                "-m",
                "pyctl",
                *on_victim("inject", t.pid),
                "--action",
                "fail",
                "--ret",
                "-7",
                "--every",
                "3",
                "--no-stack",
                "--db",
                str(tmp_path / "gf.db"),
                "--metrics-addr",
                "127.0.0.1:0",
            ],
            cwd=REPO,
        )
    except BaseException:
        t.close()
        raise
    assert ctl.stderr is not None
    url = None
    try:
        for ln in started[:-1]:  # the last is the start-up line itself
            if m := re.search(r"metrics: (http://\S+)", ln):
                url = m.group(1)
        assert url, "no metrics line before the start-up line"
        rows = t.victim(300)
        failed = sum(1 for r in rows if r[3] == -7)
        # Fire lines are rate-limited (10 in full, then a count), so they
        # cannot be awaited one by one: the endpoint is polled until it
        # counts every failed call (a fire is counted once stored), or 30 s.
        deadline = time.monotonic() + 30
        while True:
            got = _scrape(url)
            fired = sum(v for (n, _), v in got.items() if n == "gpufault_faults_fired_total")
            if fired >= failed or time.monotonic() > deadline:
                break
            assert ctl.poll() is None, f"inject ended early: {ctl.wait()}"
            time.sleep(0.05)
        assert fired == failed == 100, (fired, failed)
        key = ("gpufault_faults_active", (("run", ""),))
        assert got[key] == 1.0
        labels = [dict(lb) for (n, lb) in got if n == "gpufault_faults_fired_total"]
        assert labels == [
            {"code": "-7", "experiment": "", "function": "gf_victim", "run": "", "slo_id": ""}
        ], labels
    finally:
        ctl.send_signal(signal.SIGINT)
        _, err = finish(ctl, 60)
        t.close()
    assert ctl.returncode == 0, err
    with pytest.raises(OSError):  # closed with the run: nothing left listening
        urllib.request.urlopen(url, timeout=2)


def test_bad_metrics_addr_is_one_line_and_arms_nothing(tmp_path: Path) -> None:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyctl",
            "trace",
            "--pid",
            "1",
            "--lib",
            str(LIB),
            "--fn",
            "gf_victim",
            "--db",
            str(tmp_path / "gf.db"),
            "--metrics-addr",
            "nope",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "--metrics-addr" in p.stderr, p.stderr
    assert not (tmp_path / "gf.db").exists()


def test_a_bare_port_is_loopback_and_the_line_names_what_is_bound(tmp_path: Path) -> None:
    """`--metrics-addr :PORT` listened on every interface and printed
    127.0.0.1 (issue 25 item 6): now it binds 127.0.0.1, and the line says
    the address the socket has (checked in /proc/net/tcp, not trusted)."""
    from test_observe_metrics import _listening

    t = Target()
    try:
        argv = [sys.executable, "-m", "pyctl", *on_victim("trace", t.pid), "--db",
                str(tmp_path / "gf.db"), "--metrics-addr", ":0"]  # fmt: skip
        ctl, started = start_controller(argv, cwd=REPO)
    except BaseException:
        t.close()
        raise
    try:
        urls = [m.group(1) for ln in started if (m := re.search(r"metrics: (http://\S+)", ln))]
        assert len(urls) == 1, started
        m = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/metrics", urls[0])
        assert m, urls
        assert _listening(int(m.group(1))) == {"0100007F"}
    finally:
        ctl.send_signal(signal.SIGINT)
        finish(ctl, 60)
        t.close()
    assert ctl.returncode == 0
