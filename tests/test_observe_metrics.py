"""gpufault's own metrics endpoint (pyctl/observe/metrics.py), without Prometheus:
the text format read back with prometheus_client's parser."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from pyctl.cli.options import metrics_addr_option as metrics_option
from pyctl.observe import ObserveError
from pyctl.observe.metrics import Metrics, fire_code, parse_addr, short_function


def scrape(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(m.url, timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_parse_addr() -> None:
    assert parse_addr(":9464") == ("127.0.0.1", 9464)  # loopback unless an address is given
    assert parse_addr("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_addr("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_addr("[::1]:9464") == ("::1", 9464)
    for bad in ("9464", "host:", "host:99999", "a:b"):
        with pytest.raises(ObserveError, match="expected HOST:PORT"):
            parse_addr(bad)


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on port."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, _, p = local.partition(":")
        if int(p, 16) == port and state == "0A":  # TCP_LISTEN
            out.add(addr)
    return out


def test_a_bare_port_binds_loopback_and_says_what_it_bound() -> None:
    """:PORT listened on 0.0.0.0 and printed 127.0.0.1 (issue 25 item 6)."""
    with Metrics.start(":0") as m:
        assert m._server.socket.getsockname()[0] == "127.0.0.1"
        assert _listening(m.port) == {"0100007F"}  # 127.0.0.1, not 00000000
        assert m.url == f"http://127.0.0.1:{m.port}/metrics"
    with Metrics.start("0.0.0.0:0") as m:  # all interfaces, when asked by address
        assert _listening(m.port) == {"00000000"}
        assert m.url == f"http://0.0.0.0:{m.port}/metrics"  # what is bound, as it is


def test_noop_without_address() -> None:
    m = Metrics.start(None)
    assert not m.enabled and m.url == ""
    m.fault_fired("f", "c")
    m.set_phase("fault")
    m.set_verdict("pass")
    m.set_totals(probe_hits=3, lost=1)
    m.on_fire({"function": "f", "retval": 2})
    assert m.wait_scrape(0.01) is False
    m.close(final_scrape_s=5)  # returns at once


def test_series_and_labels() -> None:
    with Metrics.start("127.0.0.1:0", experiment="exp1", slo_id="slo1") as m:
        assert m.enabled and m.url.startswith("http://127.0.0.1:")
        m.fault_fired("cuMemAlloc_v2", "CUDA_ERROR_OUT_OF_MEMORY")
        m.on_fire(
            {
                "function": "cuMemAlloc_v2",
                "retval": 2,
                "library": "/x/libcuda.so.1",
                "action": "fail",
            }
        )
        m.on_fire({"function": "tok:hf-encode", "retval": None, "action": "stall"})
        m.set_faults_active(2)
        m.set_totals(probe_hits=10, lost=0)
        m.set_totals(probe_hits=7, lost=3)  # never backwards
        m.probe_hit(2)
        m.set_phase("baseline")
        m.set_phase("fault")
        s = scrape(m)
        lab = (("experiment", "exp1"), ("run", ""), ("slo_id", "slo1"))
        oom = (
            ("code", "CUDA_ERROR_OUT_OF_MEMORY"),
            ("experiment", "exp1"),
            ("function", "cuMemAlloc_v2"),
            ("run", ""),
            ("slo_id", "slo1"),
        )
        assert s[("gpufault_faults_fired_total", oom)] == 2
        stall = (
            ("code", "stall"),
            ("experiment", "exp1"),
            ("function", "tok:hf-encode"),
            ("run", ""),
            ("slo_id", "slo1"),
        )
        assert s[("gpufault_faults_fired_total", stall)] == 1
        run = (("run", ""),)
        assert s[("gpufault_faults_active", run)] == 2
        assert s[("gpufault_probe_hits_total", run)] == 12
        assert s[("gpufault_lost_events_total", run)] == 3
        phase = {dict(k)["phase"]: v for (n, k), v in s.items() if n == "gpufault_experiment_phase"}
        assert phase == {"baseline": 0, "fault": 1, "recovery": 0, "after": 0}
        m.set_verdict("pass")
        s = scrape(m)
        assert s[("gpufault_experiment_verdict", (*lab, ("verdict", "pass")))] == 1
        assert s[("gpufault_experiment_verdict", (*lab, ("verdict", "fail")))] == 0
        assert sum(v for (n, _k), v in s.items() if n == "gpufault_experiment_phase") == 0
    # Closed: the port is free again.
    with pytest.raises(OSError):
        urllib.request.urlopen(m.url, timeout=2)


def test_every_series_carries_the_experiment_run() -> None:
    # Two runs of one file must be two series everywhere, not only in the
    # verdict: every family, every sample has run = the experiment's id.
    with Metrics.start("127.0.0.1:0", experiment="exp1", slo_id="file-slo") as m:
        m.set_run("x0000beef")
        m.fault_fired("cuMemAlloc_v2", "CUDA_ERROR_OUT_OF_MEMORY")
        m.set_faults_active(1)
        m.set_totals(probe_hits=4, lost=1)
        m.set_phase("fault")
        m.set_slo("load.p99", "during", 0.4, False)
        m.set_burn("chat-latency", "14.4x 12s/1s", "fault", 30.0, 60.0, True)
        m.set_verdict("fail")
        s = scrape(m)
    names = {n for n, _ in s}
    assert {
        "gpufault_faults_fired_total", "gpufault_faults_active", "gpufault_probe_hits_total",
        "gpufault_lost_events_total", "gpufault_experiment_phase", "gpufault_experiment_verdict",
        "gpufault_experiment_run_verdict", "gpufault_experiment_slo_value",
        "gpufault_experiment_slo_ok", "gpufault_experiment_slo_burn_rate",
        "gpufault_experiment_slo_alert_fired",
    } <= names  # fmt: skip
    for (name, lab), _v in s.items():
        if name.startswith("gpufault_") and not name.endswith("_created"):
            assert dict(lab).get("run") == "x0000beef", (name, lab)
    burn = {dict(k)["window"]: v for (n, k), v in s.items()
            if n == "gpufault_experiment_slo_burn_rate"}  # fmt: skip
    assert burn == {"long": 30.0, "short": 60.0}
    fired = [(dict(k)["slo_id"], v) for (n, k), v in s.items()
             if n == "gpufault_experiment_slo_alert_fired"]  # fmt: skip
    assert fired == [("chat-latency", 1.0)]  # the [[slo]]'s own id, not the file's


def test_port_in_use_is_one_line() -> None:
    with Metrics.start("127.0.0.1:0") as m:
        with pytest.raises(ObserveError, match=r"--metrics-addr 127.0.0.1:\d+: .*pick another"):
            Metrics.start(f"127.0.0.1:{m.port}")


def test_fire_code_names() -> None:
    assert (
        fire_code({"retval": 2, "library": "/usr/lib/libcuda.so.1"}) == "CUDA_ERROR_OUT_OF_MEMORY"
    )
    assert fire_code({"retval": 999999, "library": "/usr/lib/libcuda.so.1"}) == "999999"
    assert fire_code({"retval": 5, "library": "/lib/libfoo.so"}) == "5"
    assert fire_code({"retval": None, "action": "signal"}) == "signal"


def test_metrics_option() -> None:
    @click.command()
    @metrics_option
    def cmd(metrics_addr: str | None) -> None:
        click.echo(repr(metrics_addr))

    r = CliRunner().invoke(cmd, ["--metrics-addr", ":9464"])
    assert r.exit_code == 0 and r.output.strip() == "':9464'"
    r = CliRunner().invoke(cmd, [])
    assert r.exit_code == 0 and r.output.strip() == "None"
    r = CliRunner().invoke(cmd, ["--metrics-addr", "nope"])
    assert r.exit_code == 2 and "expected HOST:PORT" in r.output


RUST_ENCODE = (
    "_RINvMsi_NtCscxzlFi8rOL3_10tokenizers9tokenizerINtB6_13TokenizerImplNtNtCs84oBVal8Hga_"
    "10tokenizers6models7PyModelNtNtB17_11normalizers12PyNormalizerNtNtB17_14pre_tokenizers"
    "14PyPreTokenizerNtNtB17_10processors15PyPostProcessorNtNtB17_8decoders9PyDecoderE19"
    "encode_char_offsetsNtB6_11EncodeInputEB17_"
)


def test_short_function_names() -> None:
    assert short_function("cuMemAlloc_v2") == "cuMemAlloc_v2"
    assert short_function("tok:hf-encode") == "tok:hf-encode"
    assert short_function("_ZN3foo3barEv") == "foo::bar()"
    assert short_function(RUST_ENCODE) == "TokenizerImpl::encode_char_offsets"
    assert len(short_function("x" * 500)) == 64
    with Metrics.start("127.0.0.1:0") as m:
        m.on_fire({"function": RUST_ENCODE, "retval": None, "action": "stall"})
        names = {
            dict(k).get("function")
            for (n, k), _v in scrape(m).items()
            if n == "gpufault_faults_fired_total"
        }
        assert names == {"TokenizerImpl::encode_char_offsets"}


def test_slo_terms_and_verdicts_per_run_are_series_of_their_own() -> None:
    """Two runs of one file: their SLO values and verdicts are two series
    (the `run` label, the experiment's id), not one overwritten."""
    with Metrics.start("127.0.0.1:0", experiment="stream-itl-stall", slo_id="itl") as m:
        m.set_run("x1")
        m.set_slo("load.itl_p99", "during", 0.0648, False)
        m.set_verdict("fail")
        m.set_run("x2")
        m.set_slo("load.itl_p99", "during", 0.0017, True)
        m.set_verdict("pass")
        s = scrape(m)
    lab = (("experiment", "stream-itl-stall"),)

    def get(name: str, **kw: str) -> float:
        want = tuple(sorted({**dict(lab), "slo_id": "itl", **kw}.items()))
        return s[(name, want)]

    for run, value, ok, verdict in (("x1", 0.0648, 0, "fail"), ("x2", 0.0017, 1, "pass")):
        t = {"run": run, "term": "load.itl_p99", "phase": "during"}
        assert get("gpufault_experiment_slo_value", **t) == value
        assert get("gpufault_experiment_slo_ok", **t) == ok
        assert get("gpufault_experiment_run_verdict", run=run, verdict=verdict) == 1
    assert get("gpufault_experiment_run_verdict", run="x1", verdict="pass") == 0
