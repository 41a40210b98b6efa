"""gpufault's metrics and the alerting rule, through a real Prometheus.

The reference service (a real process) and gpufault's own endpoint are
scraped every second by a Prometheus server the test starts; slow requests
(128-token completions, about 150 ms each here against a 100 ms SLO) push
the service's p99 over the rule's threshold, and the alert is read back
through pyctl.observe.alerts going inactive -> pending -> firing. No root
needed: the slow path is the service's own work, not a fault.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest
from prom_server import PROMETHEUS, PromServer
from service_proc import ServiceProc

from pyctl.observe import alerts, prometheus_files
from pyctl.observe.metrics import Metrics

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (tools/setup-deps.sh)"
)


def test_shipped_rules_are_the_generated_defaults() -> None:
    d = prometheus_files.shipped_dir()
    assert (d / "rules.yml").read_text() == prometheus_files.rules_yaml()
    assert (d / "prometheus.yml").read_text() == prometheus_files.prometheus_yaml()


@needs_prometheus
def test_promtool_accepts_shipped_files(tmp_path: Path) -> None:
    d = prometheus_files.shipped_dir()
    for args in (
        ["check", "rules", str(d / "rules.yml")],
        ["check", "config", str(d / "prometheus.yml")],
    ):
        r = subprocess.run(["promtool", *args], cwd=d, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
    # And a rendering with the tests' numbers.
    (tmp_path / "r.yml").write_text(prometheus_files.rules_yaml(p99_s=0.1, for_="2s"))
    r = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "r.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture
def service():
    s = ServiceProc("--device", "cpu")
    try:
        yield s
    finally:
        s.close()


@pytest.mark.slow
@needs_prometheus
def test_alert_pending_then_firing_and_gpufault_series(tmp_path: Path, service) -> None:
    slo = "test-p99"
    metrics = Metrics.start("127.0.0.1:0", experiment="e2e-slow", slo_id=slo)
    prom = None
    try:
        prom = PromServer(
            tmp_path / "prom",
            service=[f"{service.host}:{service.port}"],
            gpufault=[f"127.0.0.1:{metrics.port}"],
            rules=prometheus_files.rules_yaml(p99_s=0.1, for_="2s", rate_window="5s", slo_id=slo),
        )
        prom.wait_target_up("gf-service")
        prom.wait_target_up("gpufault")

        # gpufault's own series, as an experiment would drive them.
        metrics.set_phase("baseline")
        metrics.set_faults_active(1)
        metrics.fault_fired("cuMemAlloc_v2", "CUDA_ERROR_OUT_OF_MEMORY", n=2)
        metrics.set_totals(probe_hits=40, lost=1)

        # Baseline: fast requests keep the p99 under the SLO.
        for _ in range(10):
            assert service.complete(max_tokens=2)[0] == 200
        assert (
            alerts.alert_state(prom.url, prometheus_files.P99_ALERT, {"slo_id": slo}) == "inactive"
        )

        # The slow path: 4 clients of 128-token completions until it fires.
        metrics.set_phase("fault")
        stop = threading.Event()
        t_load = time.time()

        def client() -> None:
            deadline = time.monotonic() + 90
            while not stop.is_set() and time.monotonic() < deadline:
                service.complete(max_tokens=128)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        seen: list[str] = []
        try:
            fired = alerts.wait_first_firing(
                prom.url, prometheus_files.P99_ALERT, {"slo_id": slo}, timeout=60, states_seen=seen
            )
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert fired is not None, f"never fired; states seen {seen}\n{prom.log.read_text()}"
        assert seen[0] == "inactive" and "pending" in seen and seen[-1] == "firing", seen
        assert fired.labels["slo_id"] == slo and fired.labels["severity"] == "page"
        # Pending for the rule's `for:` (2 s) before firing.
        assert fired.active_at is not None and fired.seen_at - fired.active_at >= 2.0
        # Looked back through the ALERTS series: the same episode.
        first = alerts.first_firing(
            prom.url, prometheus_files.P99_ALERT, {"slo_id": slo}, t_load, time.time() + 1
        )
        assert first is not None and t_load < first <= fired.seen_at + 1.0

        # The Prometheus query probe's helper over the same server.
        p99 = alerts.query(prom.url, prometheus_files.p99_expr("5s"))
        assert p99 and p99[0][1] > 0.1

        # gpufault's endpoint as Prometheus stored it.
        got = alerts.query(prom.url, "gpufault_faults_fired_total")
        assert [(m["function"], m["code"], m["experiment"], m["slo_id"], v) for m, v in got] == [
            ("cuMemAlloc_v2", "CUDA_ERROR_OUT_OF_MEMORY", "e2e-slow", slo, 2.0)
        ]
        # The phase gauge follows within a scrape or two.
        metrics.wait_scrape(5)
        metrics.wait_scrape(5)
        phases = {m["phase"]: v for m, v in alerts.query(prom.url, "gpufault_experiment_phase")}
        assert phases == {"baseline": 0, "fault": 1, "recovery": 0, "after": 0}
        assert alerts.query(prom.url, "gpufault_lost_events_total")[0][1] == 1.0
        assert alerts.query(prom.url, "gpufault_probe_hits_total")[0][1] == 40.0
        assert alerts.query(prom.url, "gpufault_faults_active")[0][1] == 1.0

        # The verdict reaches Prometheus before the endpoint closes.
        metrics.set_verdict("fail")
        metrics.wait_scrape(5)  # a scrape in flight may predate the verdict
        metrics.close(final_scrape_s=5)
        v = {
            m["verdict"]: val
            for m, val in alerts.query(
                prom.url, 'gpufault_experiment_verdict{experiment="e2e-slow"}'
            )
        }
        assert v == {"pass": 0, "fail": 1, "aborted": 0, "error": 0}

        # Load gone: the alert resolves (the rate over 5 s has no requests).
        deadline = time.monotonic() + 30
        while alerts.alert_state(prom.url, prometheus_files.P99_ALERT) != "inactive":
            assert time.monotonic() < deadline, "alert never resolved"
            time.sleep(0.5)
    finally:
        metrics.close()
        if prom is not None:
            prom.close()
