"""Arrival processes of the load generator (pyctl/experiment/arrival.py):
constant, seeded Poisson, bursts and a closed loop of N clients, as plans,
as what the scheduler really emits against tests/delay_server.py, and as
[load] arrival keys (one-line refusals, the seed in the stored file)."""

from __future__ import annotations

import json
import statistics
import threading
from pathlib import Path

import pytest
from delay_server import DelayServer
from expfile import header

from pyctl.experiment import load as F
from pyctl.experiment.arrival import Arrival
from pyctl.experiment.loadgen import LoadError, OpenLoopLoad, Sample
from pyctl.experiment.model import ExperimentError


def _first(a: Arrival, n: int) -> list[float]:
    it = a.offsets()
    return [next(it) for _ in range(n)]


def _run(load: OpenLoopLoad) -> list[Sample]:
    load.start()
    assert load.wait(60)
    load.stop()
    return load.samples()


# ---- plans ----------------------------------------------------------------------------------


def test_constant_and_burst_plans_are_exact() -> None:
    assert _first(Arrival("constant", rate=4), 5) == [0, 0.25, 0.5, 0.75, 1.0]
    b = _first(Arrival("burst", size=3, every=0.5), 7)
    assert b == [0, 0, 0, 0.5, 0.5, 0.5, 1.0]
    assert Arrival("burst", size=20, every=0.1).mean_rate == pytest.approx(200)
    assert Arrival("closed", clients=3).mean_rate is None


def test_poisson_plan_is_the_seeds_and_exponential() -> None:
    a, b, c = (Arrival("poisson", rate=200, seed=s) for s in (7, 7, 8))
    pa, pb, pc = _first(a, 20001), _first(b, 20001), _first(c, 20001)
    assert pa == pb  # the same seed plans the same send times
    assert pa != pc
    gaps = [y - x for x, y in zip(pa, pa[1:], strict=False)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / 200, rel=0.03)
    # exponential: its standard deviation equals its mean (constant gaps: 0)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, abs=0.05)
    assert all(g >= 0 for g in gaps) and pa[0] == 0.0
    # another draw elsewhere in the process does not change the plan
    import random

    random.seed(1)
    assert _first(Arrival("poisson", rate=200, seed=7), 50) == pa[:50]


@pytest.mark.parametrize(
    "kw",
    [
        {"kind": "poisson", "rate": 10},  # no seed: the plan would not be reproducible
        {"kind": "uniform"},
        {"kind": "burst", "size": 0, "every": 1.0},
        {"kind": "burst", "size": 2, "every": 0.0},
        {"kind": "closed"},
        {"kind": "constant", "rate": 0},
    ],
)
def test_bad_arrivals_fail_where_built(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Arrival(**kw)  # type: ignore[arg-type]


# ---- the scheduler follows the plan -------------------------------------------------------


def test_poisson_load_sends_on_the_seeds_plan() -> None:
    a = Arrival("poisson", rate=100, seed=11)
    with DelayServer(0.002) as srv:
        s = _run(OpenLoopLoad(srv.url, 1, arrival=a, duration=1.0, concurrency=16))
    plan = [x for x in _first(a, 1000) if x < 1.0]
    assert len(s) == len(plan) and all(x.ok for x in s)
    for x, want in zip(s, plan, strict=True):
        assert x.due - s[0].due == pytest.approx(want, abs=1e-6)
    assert sorted(x.index for x in s) == list(range(len(plan)))


def test_bursts_are_due_together_and_reach_the_server_together() -> None:
    a = Arrival("burst", size=5, every=0.2)
    with DelayServer(0.01) as srv:
        load = OpenLoopLoad(srv.url, 1, arrival=a, duration=1.0, concurrency=8)
        s = _run(load)
        log = srv.log
    assert len(s) == 25 and all(x.ok for x in s), load.counts()
    dues = sorted({round(x.due - s[0].due, 6) for x in s})
    assert dues == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8], abs=1e-6)
    # the server saw five groups of five: within a burst the arrivals are
    # much closer together than the 200 ms between bursts
    t = sorted(at for at, _took in log)
    groups = [t[i : i + 5] for i in range(0, 25, 5)]
    assert all(g[-1] - g[0] < 0.1 for g in groups), groups
    assert all(b[0] - a[-1] > 0.1 for a, b in zip(groups, groups[1:], strict=False))
    assert load.rate == pytest.approx(25)
    # a burst is handed over in one go, all stamped with the one wake-up:
    # its fifth request is not charged for the four puts before it
    lags = load._sched_lag
    assert len(lags) == 25
    assert all(len(set(lags[i : i + 5])) == 1 for i in range(0, 25, 5)), lags


def test_a_burst_larger_than_the_connections_is_refused() -> None:
    with pytest.raises(LoadError, match="concurrency >= 10"):
        OpenLoopLoad("http://127.0.0.1:9", 1, arrival=Arrival("burst", size=10, every=1.0),
                     concurrency=4)  # fmt: skip


def test_closed_loop_keeps_exactly_n_requests_in_flight() -> None:
    """Three clients, a server that holds every answer: exactly three
    requests reach it and no fourth until one is answered; then each client
    sends its next one at once (due = sent)."""
    srv = DelayServer(0.0)
    srv.gate = threading.Event()
    srv.start()
    try:
        load = OpenLoopLoad(srv.url, 1, arrival=Arrival("closed", clients=3), timeout=30)
        load.start()
        for _ in range(3):
            assert srv.entered.acquire(timeout=10)
        # a fourth would be an open loop: give it ample time to show up
        assert not srv.entered.acquire(timeout=0.3)
        assert load.counts()["sent"] == 3 and load.counts()["in_flight"] == 3
        srv.gate.set()
        for _ in range(30):  # they go on, each after its last answer
            assert srv.entered.acquire(timeout=10)
        load.stop()
        s = load.samples()
        conns = srv.httpd.connections
    finally:
        srv.close()
    assert len(s) >= 33 and all(x.ok for x in s)
    # due when the client is free: only a first connect lies before the send
    assert all(0 <= x.lag < 0.05 for x in s), [x.lag for x in s]
    assert conns == 3  # keep-alive, one connection per client
    assert load.counts()["sched_lag_ms"]["p99"] is None


def test_closed_loop_throughput_is_clients_over_latency() -> None:
    with DelayServer(0.02) as srv:
        load = OpenLoopLoad(srv.url, 1, arrival=Arrival("closed", clients=4), duration=1.0)
        s = _run(load)
    # 4 clients x (1 s / ~20 ms) = about 200; each waits for its answer
    assert 100 <= len(s) <= 205, len(s)
    by_client_in_flight = max(
        sum(1 for y in s if y.sent <= x.sent < y.done) for x in s
    )  # requests in flight when each one was sent (itself included)
    assert by_client_in_flight <= 4


def test_closed_loop_against_a_dead_port_backs_off() -> None:
    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens: every connection is refused at once
    load = OpenLoopLoad(
        f"http://127.0.0.1:{port}", 1, arrival=Arrival("closed", clients=2), duration=0.5
    )
    s = _run(load)
    assert s and all(x.error == "conn" for x in s)
    # 2 clients, >= 10 ms apart each: at most ~100 tries in 0.5 s, not thousands
    assert len(s) <= 2 * (0.5 / 0.01) + 4, len(s)


# ---- [load] arrival keys ------------------------------------------------------------------

BASE = header("a")


def _exp(tmp_path: Path, text: str):
    p = tmp_path / "a.toml"
    p.write_text(BASE + text)
    return F.load_file(p)


def test_load_arrival_keys(tmp_path: Path) -> None:
    e = _exp(tmp_path, '[load]\nrate = 50\narrival = { kind = "poisson", seed = 9 }\n')
    assert e.load is not None and e.load.plan() == Arrival("poisson", rate=50, seed=9)
    e = _exp(tmp_path, '[load]\nconcurrency = 32\narrival = { kind = "burst", size = 20, '
                       'every = "100ms" }\n')  # fmt: skip
    assert e.load is not None and e.load.plan() == Arrival("burst", size=20, every=0.1)
    assert e.load.rate == pytest.approx(200)  # what the windows and bodies count on
    e = _exp(tmp_path, '[load]\narrival = { kind = "closed", clients = 6 }\n')
    assert e.load is not None and e.load.concurrency == 6 and e.load.plan().clients == 6
    e = _exp(tmp_path, "[load]\nrate = 7\n")
    assert e.load is not None and e.load.arrival is None
    assert e.load.plan() == Arrival("constant", rate=7)


def test_load_realtime_key(tmp_path: Path) -> None:
    """The scheduler's real-time policy is on unless the file says no; a
    value that is not a boolean is one line."""
    e = _exp(tmp_path, "[load]\nrate = 7\n")
    assert e.load is not None and e.load.realtime is True
    e = _exp(tmp_path, "[load]\nrate = 7\nrealtime = false\n")
    assert e.load is not None and e.load.realtime is False
    e = _exp(tmp_path, '[load]\nrate = 7\nrealtime = "slice"\n')
    assert e.load is not None and e.load.realtime == "slice"
    for bad in ('"yes"', "1"):
        with pytest.raises(ExperimentError) as ei:
            _exp(tmp_path, f"[load]\nrealtime = {bad}\n")
        msg = str(ei.value)
        assert "load.realtime" in msg and 'give true, false or "slice"' in msg and "\n" not in msg


def test_a_poisson_load_without_a_seed_gets_one_into_the_stored_file(tmp_path: Path) -> None:
    e = _exp(tmp_path, '[load]\nrate = 50\narrival = "poisson"\n')
    assert e.load is not None and e.load.arrival is not None
    seed = e.load.arrival.seed
    assert isinstance(seed, int)
    stored = json.loads(json.dumps(e.expanded))["load"]["arrival"]
    assert stored == {"kind": "poisson", "seed": seed}
    # the stored table, given back, plans the same run
    again = _exp(tmp_path, f'[load]\nrate = 50\narrival = {{ kind = "poisson", seed = {seed} }}\n')
    assert again.load is not None and again.load.plan() == e.load.plan()
    assert e.load.plan().describe() == f"poisson 50/s open loop (seed {seed}, drawn)"
    assert again.load.plan().describe() == f"poisson 50/s open loop (seed {seed})"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('arrival = "uniform"', "load.arrival.kind: 'uniform': use one of constant, poisson"),
        ("arrival = 3", 'load.arrival: expected "constant", "poisson" or a table'),
        ('arrival = { kind = "poisson", size = 3 }', "load.arrival.size: not a key of a poisson"),
        ('arrival = { kind = "poisson", seed = -1 }', "load.arrival.seed: -1 is below 0"),
        ('arrival = { kind = "poisson", sede = 1 }', "load.arrival.sede: unknown key"),
        ('rate = 9\narrival = { kind = "burst", size = 2, every = "1s" }', "load.rate: a burst"),
        ('arrival = { kind = "burst", size = 2 }', "load.arrival.every: missing"),
        ('arrival = { kind = "burst", size = 100, every = "1s" }', "concurrency >= 100"),
        ('arrival = { kind = "burst", size = 50, every = "1ms" }', "size / every <= 10000"),
        ('arrival = { kind = "closed" }', "load.arrival.clients: missing"),
        ('concurrency = 4\narrival = { kind = "closed", clients = 2 }', "load.concurrency: a"),
        ('rate = 4\narrival = { kind = "closed", clients = 2 }', "load.rate: a closed"),
    ],
)
def test_bad_arrival_keys_are_one_line(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ExperimentError) as ei:
        _exp(tmp_path, f"[load]\n{text}\n")
    msg = str(ei.value)
    assert "\n" not in msg and words in msg and str(tmp_path / "a.toml") in msg, msg


# ---- end to end: the reference service, a chat prompt set, a Poisson load ------------------

RUN = """
name = "arrivals"
version = 1
title = "a Poisson chat load from a prompt set, no fault"
[target]
service = { device = "cpu", args = ["--batch-wait", "0"] }
[load]
arrival = "poisson"
rate = 20
path = "/v1/chat/completions"
prompts = "chat.jsonl"
stream = true
max_tokens = 3
body = { messages = "$messages", max_tokens = "$max_tokens", stream = true }
[phases]
warmup = "500ms"
baseline = "2s"
method = "2s"
recovery = "1s"
[steady_state]
p99 = "<= 3s"
error_rate = "<= 5%"
ttft_p99 = "<= 3s"
quorum = "50%"
"""


def test_a_poisson_chat_load_from_a_prompt_set_runs_and_its_seed_is_evidence(
    tmp_path: Path,
) -> None:
    import os
    import sqlite3
    import subprocess
    import sys

    rows = [
        {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "ka tu"}]},
        {"prompt": "mi sa ro", "max_tokens": 2},
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    f = tmp_path / "arrivals.toml"
    f.write_text(RUN)
    db = tmp_path / "gf.db"
    p = subprocess.run(
        [sys.executable, "-m", "pyctl", "experiment", "run", str(f), "--db", str(db), "--json"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ},
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    doc = json.loads(p.stdout)
    assert doc["verdict"] == "pass", doc["reason"]
    c = sqlite3.connect(db)
    try:
        (settings,) = c.execute("SELECT settings FROM experiments").fetchone()
    finally:
        c.close()
    load = json.loads(settings)["file"]["load"]
    seed = load["arrival"]["seed"]
    assert load["arrival"] == {"kind": "poisson", "seed": seed} and isinstance(seed, int)
    assert f"load: poisson 20/s open loop (seed {seed}, drawn)" in out
    assert load["prompts_file"]["entries"] == 2 and len(load["prompts_file"]["sha256"]) == 64
    ttft = {x["phase"]: x for x in doc["slo"] if x["term"] == "load.ttft_p99"}
    assert ttft["before"]["ok"] and ttft["before"]["value"] > 0  # chat answers streamed
