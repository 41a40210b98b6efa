"""The closed loop through a real Prometheus (root: BPF uprobes).

The reference service runs on the libcuda TEST DOUBLE (cpu-double); a
Prometheus server scrapes it every second with gpufault's breaker rule; an
experiment (the experiment runner, a file written here) arms sticky
CUDA_ERROR_OUT_OF_MEMORY in the double's cuMemAlloc_v2 and asserts
`alert_fired` with a Prometheus probe over the ALERTS series: the alert is
Prometheus' own, evaluated from the service's metrics. Then the report of
that experiment shows the alert in its matrix.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from prom_server import PROMETHEUS, PromServer, free_port
from service_proc import ServiceProc

from pyctl import paths
from pyctl.observe import alerts, prometheus_files

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="requires root (BPF, ptrace)"),
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed"),
    pytest.mark.skipif(
        not paths.DOUBLE_LIBCUDA.exists(), reason="run `make build` (the libcuda test double)"
    ),
]

EXPERIMENT = """\
name = "oom-alert-via-prometheus"
version = 1
title = "sticky OOM; the breaker alert read from Prometheus"
slo_id = "completions-availability"

[target]
url = "{url}"
pid = {pid}

[load]
rate = 20.0
prompt = "hello world"
max_tokens = 4
timeout = "2s"

[phases]
baseline = "3s"
recovery = "6s"

[steady_state]
error_rate = "<= 1%"

[probes.breaker-alert]
kind = "prometheus"
mode = "continuous"
url = "{prom}"
query = 'count(ALERTS{{alertname="{alert}", alertstate="firing"}}) or vector(0)'
tolerance = ">= 1"
interval = "500ms"
timeout = "2s"

[[method]]
template = "cuda-oom-sticky"
set = {{ after = 2 }}
start = "0s"
duration = "6s"

[expect]
alert_fired = {{ probe = "breaker-alert", within = "5s" }}
"""


def test_alert_fired_through_prometheus(tmp_path: Path) -> None:
    svc = ServiceProc(
        "--device",
        "cpu-double",
        "--batch-wait",
        "0",
        "--breaker-errors",
        "3",
        "--breaker-cooldown",
        "500ms",
    )
    prom = None
    gf_port = free_port()  # gpufault's own /metrics (--metrics-addr), scraped too
    try:
        prom = PromServer(
            tmp_path / "prom",
            service=[f"{svc.host}:{svc.port}"],
            gpufault=[f"127.0.0.1:{gf_port}"],
            rules=prometheus_files.rules_yaml(for_="1s", rate_window="5s"),
        )
        prom.wait_target_up("gf-service")
        assert alerts.alert_state(prom.url, prometheus_files.BREAKER_ALERT) == "inactive"
        exp = tmp_path / "oom.toml"
        exp.write_text(
            EXPERIMENT.format(
                url=svc.url, pid=svc.pid, prom=prom.url, alert=prometheus_files.BREAKER_ALERT
            )
        )
        db = tmp_path / "gf.db"
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pyctl",
                "experiment",
                "run",
                str(exp),
                "--db",
                str(db),
                "--metrics-addr",
                f"127.0.0.1:{gf_port}",
                "--metrics-linger",
                "5s",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)),
        )
        assert r.returncode == 0, r.stdout + r.stderr
        conn = sqlite3.connect(db)
        ((eid, started, ended),) = conn.execute(
            "SELECT id, started_at, ended_at FROM experiments"
        ).fetchall()
        ok, value, detail = conn.execute(
            "SELECT ok, value, detail FROM expectations WHERE name = 'alert_fired'"
        ).fetchone()
        conn.close()
        assert ok == 1 and value is not None and value <= 5, detail
        # Prometheus' own record of the same alert, looked back.
        first = alerts.first_firing(
            prom.url, prometheus_files.BREAKER_ALERT, {}, started, ended + 1
        )
        assert first is not None and started < first < ended
        # gpufault's own series, as Prometheus scraped them: the step's
        # fires (its child controller's rows, fed back by the runner) by
        # function and code, under the experiment's name, and its verdict.
        # max_over_time: the endpoint is gone now, and an instant query
        # would see the staleness marker of its last failed scrape.
        conn = sqlite3.connect(db)
        (fires,) = conn.execute("SELECT count(*) FROM faults").fetchone()
        conn.close()
        got = alerts.query(prom.url, "max_over_time(gpufault_faults_fired_total[5m])")
        assert [(lb["function"], lb["code"], lb["experiment"]) for lb, _v in got] == [
            ("cuMemAlloc_v2", "CUDA_ERROR_OUT_OF_MEMORY", "oom-alert-via-prometheus")
        ], got
        assert fires >= 1 and got[0][1] == fires, (got, fires)
        verdict = alerts.query(
            prom.url, 'max_over_time(gpufault_experiment_verdict{verdict="pass"}[5m])'
        )
        assert [v for _lb, v in verdict] == [1.0], verdict
        hits = alerts.query(prom.url, "max_over_time(gpufault_probe_hits_total[5m])")
        assert hits and hits[0][1] >= fires, hits

        from pyctl.evidence import store
        from pyctl.report import render_html

        rdb = store.open_db(db, readonly=True)
        try:
            html = render_html(rdb, [eid])
        finally:
            rdb.close()
        assert 'data-expectation="alert_fired"' in html and "✓ after" in html
        assert 'class="fault-marker"' in html
    finally:
        if prom is not None:
            prom.close()
        svc.close()
