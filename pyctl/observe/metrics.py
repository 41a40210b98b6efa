"""gpufault's own /metrics (`--metrics-addr HOST:PORT`), for Prometheus.

One CollectorRegistry per Metrics object (never the process-wide default
one: the reference service or a test may hold that), served over HTTP on a
thread of this process. Every method is a no-op when no address was given,
so the engine, the runner and the experiment runner call them
unconditionally::

    m = Metrics.start(addr, experiment="cuda-oom", slo_id="chat-p99")  # addr None: no-op
    m.set_faults_active(2)
    m.fault_fired("cuMemAlloc_v2", "CUDA_ERROR_OUT_OF_MEMORY")   # or m.on_fire(row)
    lost = engine.lost()
    m.set_totals(probe_hits=engine.stats.events, lost=lost["events_lost"] + lost["fires_lost"])
    m.set_phase("fault"); ...; m.set_verdict("pass")
    m.close(final_scrape_s=3.0)   # lets Prometheus read the verdict first

Series (docs/observability.md):
    gpufault_faults_fired_total{function,code,experiment,slo_id,run}  counter
    gpufault_faults_active{run}                                   gauge
    gpufault_probe_hits_total{run}                                counter
    gpufault_lost_events_total{run}                               counter
    gpufault_experiment_phase{experiment,slo_id,run,phase}        gauge, 1 = current
    gpufault_experiment_verdict{experiment,slo_id,run,verdict}    gauge, 1 at the end
    gpufault_experiment_run_verdict{experiment,slo_id,run,verdict} gauge, 1 at the end
    gpufault_experiment_slo_value{experiment,slo_id,run,term,phase} gauge (seconds, share, rate)
    gpufault_experiment_slo_ok{experiment,slo_id,run,term,phase}  gauge, 1 met, 0 breached
    gpufault_experiment_slo_burn_rate{experiment,slo_id,run,alert,window,phase} gauge
    gpufault_experiment_slo_alert_fired{experiment,slo_id,run,alert,phase} gauge, 1 fired
    gpufault_experiment_slo_burn_rate_now{experiment,slo_id,run,alert,window} gauge, live
    gpufault_experiment_slo_alert_firing{experiment,slo_id,run,alert}  gauge, live 1 firing
Every series has the `run` label, the experiment's id (x1a2b3c4d; empty
outside an experiment): two runs of one file are two series, not one
overwritten. A burn-rate SLO's series carry its own id ([[slo]] id) as
slo_id.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app

from pyctl.observe import ObserveError
from pyctl.observe.names import fire_code, short_function

# The phases an experiment goes through (probe_samples.phase), in order;
# set_phase() zeroes the others so exactly one reads 1.
PHASES = ("baseline", "fault", "recovery", "after")
VERDICTS = ("pass", "fail", "aborted", "error")


def parse_addr(text: str) -> tuple[str, int]:
    """'HOST:PORT', ':PORT' (loopback), '[::1]:PORT' -> (host, port).

    A bare :PORT is 127.0.0.1: the metrics name the target's functions and
    faults, which other machines have no business reading; all interfaces
    only when asked for by address (0.0.0.0:PORT, [::]:PORT).
    ObserveError names the option and what is expected."""
    t = text.strip()
    host, sep, port = t.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ObserveError(
            f"--metrics-addr {text!r}: expected HOST:PORT or :PORT (127.0.0.1), "
            "e.g. :9464 or 0.0.0.0:9464 (all interfaces)"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "127.0.0.1", int(port)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib's name
        pass  # a scrape a second must not write to the user's terminal


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class Metrics:
    """gpufault's metrics; Metrics() (no address) is the no-op instance."""

    def __init__(self, *, experiment: str = "", slo_id: str = "") -> None:
        self.experiment = experiment
        self.slo_id = slo_id
        self.enabled = False
        self.url = ""
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._scraped = threading.Condition()
        self._scrapes = 0
        self._phase: tuple[str, str, str] | None = None
        self.run = ""  # the experiment's id once it has one (set_run)
        self._hits = 0.0
        self._lost = 0.0

    # ---- start/stop -----------------------------------------------------------
    @classmethod
    def start(cls, addr: str | None, *, experiment: str = "", slo_id: str = "") -> Metrics:
        """Serve on addr ('HOST:PORT', ':PORT'; port 0: the kernel picks, see
        .url); None or '': the no-op instance."""
        m = cls(experiment=experiment, slo_id=slo_id)
        if addr:
            m._serve(*parse_addr(addr))
        return m

    def _serve(self, host: str, port: int) -> None:
        reg = CollectorRegistry(auto_describe=True)
        lab = ["experiment", "slo_id", "run"]
        self.registry = reg
        self._fired = Counter(
            "gpufault_faults_fired",
            "faults gpufault fired (one per fault ID)",
            ["function", "code", *lab],
            registry=reg,
        )
        self._active = Gauge(
            "gpufault_faults_active", "fault specs armed now", ["run"], registry=reg
        )
        self._hits_c = Counter(
            "gpufault_probe_hits", "calls the probes saw (fired or not)", ["run"], registry=reg
        )
        self._lost_c = Counter(
            "gpufault_lost_events",
            "events the BPF side dropped (ring full, map full)",
            ["run"],
            registry=reg,
        )

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            """An experiment gauge: its labels after the experiment's own."""
            return Gauge(name, doc, [*lab, *labels], registry=reg)

        self._phase_g = gauge(
            "gpufault_experiment_phase",
            "1 for the running experiment's current phase",
            "phase",
        )
        self._verdict_g = gauge(
            "gpufault_experiment_verdict",
            "1 for a finished experiment's verdict",
            "verdict",
        )
        self._run_verdict_g = gauge(
            "gpufault_experiment_run_verdict",
            "1 for a finished experiment run's verdict (run: the experiment's id)",
            "verdict",
        )
        self._slo_value_g = gauge(
            "gpufault_experiment_slo_value",
            "a load hypothesis term's value over a phase (latencies in seconds)",
            "term",
            "phase",
        )
        self._slo_ok_g = gauge(
            "gpufault_experiment_slo_ok",
            "1 when the term's bound held in the phase (its quorum of 1 s windows), else 0",
            "term",
            "phase",
        )
        self._burn_g = gauge(
            "gpufault_experiment_slo_burn_rate",
            "a burn-rate SLO's worst burn rate in a phase over an alert's long or short "
            "window (bad share / error budget; slo_id: the [[slo]]'s id)",
            "alert",
            "window",
            "phase",
        )
        self._burn_now_g = gauge(
            "gpufault_experiment_slo_burn_rate_now",
            "a burn-rate SLO's burn rate over an alert's long or short window ending at the "
            "latest settled 1 s window, while the experiment runs",
            "alert",
            "window",
        )
        self._firing_now_g = gauge(
            "gpufault_experiment_slo_alert_firing",
            "1 while the burn-rate alert pair fires (both windows above its factor), live",
            "alert",
        )
        self._alert_g = gauge(
            "gpufault_experiment_slo_alert_fired",
            "1 when the burn-rate alert pair fired in the phase (both windows above its factor)",
            "alert",
            "phase",
        )
        app = make_wsgi_app(reg)

        def counted(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            body = app(environ, start_response)
            with self._scraped:
                self._scrapes += 1
                self._scraped.notify_all()
            return body

        cls = _Server6 if ":" in host else _Server
        try:
            self._server = make_server(host, port, counted, server_class=cls, handler_class=_Quiet)
        except OSError as e:
            raise ObserveError(
                f"--metrics-addr {host}:{port}: {e.strerror or e}; pick another port"
            ) from None
        bound_host, bound_port = (str(a) for a in self._server.server_address[:2])
        # What is bound, as it is (0.0.0.0 says "every interface"), never a
        # friendlier address than the socket's.
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url = f"http://{shown}:{bound_port}/metrics"
        self.port = int(bound_port)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="gf-metrics",
            daemon=True,
        )
        self._thread.start()
        self.enabled = True

    def wait_scrape(self, timeout: float) -> bool:
        """Wait for the next scrape after now (True) or timeout (False)."""
        if not self.enabled:
            return False
        with self._scraped:
            seen = self._scrapes
            return self._scraped.wait_for(lambda: self._scrapes > seen, timeout)

    def close(self, final_scrape_s: float = 0.0) -> None:
        """Stop serving; with final_scrape_s > 0 first wait (at most that long)
        for one more scrape, so Prometheus records the verdict that was just
        set before the endpoint goes away."""
        if not self.enabled:
            return
        if final_scrape_s > 0:
            self.wait_scrape(final_scrape_s)
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        self.enabled = False

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- what the engine, runner and experiment runner report -----------------
    def _labels(self, experiment: str | None, slo_id: str | None) -> dict[str, str]:
        return {
            "experiment": self.experiment if experiment is None else experiment,
            "slo_id": self.slo_id if slo_id is None else slo_id,
            "run": self.run,
        }

    def set_experiment(self, experiment: str, slo_id: str = "") -> None:
        """The labels later calls use by default (an experiment run sets
        them once it has read its file)."""
        self.experiment, self.slo_id = experiment, slo_id

    def set_run(self, run: str) -> None:
        """The experiment's id: the `run` label of the per-run series."""
        self.run = run

    def set_slo(self, term: str, phase: str, value: float, ok: bool) -> None:
        """One load hypothesis term of a phase (before, during, after)."""
        if not self.enabled:
            return
        lab = {**self._labels(None, None), "term": term, "phase": phase}
        self._slo_value_g.labels(**lab).set(value)
        self._slo_ok_g.labels(**lab).set(1 if ok else 0)

    def fault_fired(
        self,
        function: str,
        code: str,
        *,
        experiment: str | None = None,
        slo_id: str | None = None,
        n: int = 1,
    ) -> None:
        if self.enabled:
            self._fired.labels(
                function=function, code=code, **self._labels(experiment, slo_id)
            ).inc(n)

    def on_fire(self, row: dict[str, Any]) -> None:
        """An Engine.on_fire / runner.run(on_fire=...) callback: one fault row."""
        if self.enabled:
            self.fault_fired(short_function(str(row.get("function") or "?")), fire_code(row))

    def set_faults_active(self, n: int) -> None:
        if self.enabled:
            self._active.labels(run=self.run).set(n)

    def set_totals(self, *, probe_hits: float | None = None, lost: float | None = None) -> None:
        """Cumulative totals as the engine keeps them (stats.events, the sum of
        lost()): the counters advance by the difference, never backwards."""
        if not self.enabled:
            return
        if probe_hits is not None and probe_hits > self._hits:
            self._hits_c.labels(run=self.run).inc(probe_hits - self._hits)
            self._hits = probe_hits
        if lost is not None and lost > self._lost:
            self._lost_c.labels(run=self.run).inc(lost - self._lost)
            self._lost = lost

    def probe_hit(self, n: int = 1) -> None:
        if self.enabled and n > 0:
            self._hits_c.labels(run=self.run).inc(n)
            self._hits += n

    def set_phase(
        self, phase: str, *, experiment: str | None = None, slo_id: str | None = None
    ) -> None:
        """phase reads 1, every other phase of this experiment 0."""
        if not self.enabled:
            return
        lab = self._labels(experiment, slo_id)
        for p in {*PHASES, phase}:
            self._phase_g.labels(**lab, phase=p).set(1 if p == phase else 0)
        self._phase = (lab["experiment"], lab["slo_id"], phase)

    def set_burn_now(
        self, slo_id: str, alert: str, long_burn: float, short_burn: float, firing: bool
    ) -> None:
        """A burn-rate SLO's alert pair as of the latest settled window (live)."""
        if not self.enabled:
            return
        lab = {**self._labels(None, slo_id), "alert": alert}
        self._burn_now_g.labels(**lab, window="long").set(long_burn)
        self._burn_now_g.labels(**lab, window="short").set(short_burn)
        self._firing_now_g.labels(**lab).set(1 if firing else 0)

    def set_burn(
        self, slo_id: str, alert: str, phase: str, long_burn: float, short_burn: float,
        fired: bool,
    ) -> None:  # fmt: skip
        """One burn-rate SLO's alert pair over a phase (its worst burn rates)."""
        if not self.enabled:
            return
        lab = {**self._labels(None, slo_id), "alert": alert, "phase": phase}
        self._burn_g.labels(**lab, window="long").set(long_burn)
        self._burn_g.labels(**lab, window="short").set(short_burn)
        self._alert_g.labels(**lab).set(1 if fired else 0)

    def set_verdict(
        self, verdict: str, *, experiment: str | None = None, slo_id: str | None = None
    ) -> None:
        """At the end: the verdict reads 1 (the others 0) and no phase is current."""
        if not self.enabled:
            return
        lab = self._labels(experiment, slo_id)
        for v in {*VERDICTS, verdict}:
            self._verdict_g.labels(**lab, verdict=v).set(1 if v == verdict else 0)
            self._run_verdict_g.labels(**lab, verdict=v).set(1 if v == verdict else 0)
        for p in PHASES:
            self._phase_g.labels(**lab, phase=p).set(0)
        self._phase = None
