"""Multi-window burn-rate SLOs ([[slo]], pyctl/experiment/burn.py): the
file's tables (bad ones refused in one line at validate time), the burn
rate arithmetic against hand-made samples (a known bad share is a known
burn; a pair fires only when both windows burn; the short window stops
it soon after the burn stops), and, as root, the shipped
stream-slo-burn file against the reference service: a 60 ms decode stall
burns the budget and fails the run, a 1 ms one does not and passes, with
the slo_id in the evidence rows."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyctl import paths
from pyctl.experiment import burn
from pyctl.experiment import load as F
from pyctl.experiment.loadgen import Sample
from pyctl.experiment.model import ExperimentError

REPO = Path(__file__).resolve().parent.parent

BASE = """
name = "b"
version = 1
title = "t"
slo_id = "file-slo"
[target]
service = { device = "cpu-double" }
[load]
rate = 10.0
stream = true
[[method]]
template = "cuda-stream-stall"
set = { fn = "cuCtxSynchronize", stall = "10ms", prob = "10%" }
start = "0s"
duration = "1s"
"""


def _file(tmp_path: Path, slo: str, base: str = BASE) -> Path:
    p = tmp_path / "b.toml"
    p.write_text(base + slo)
    return p


def test_slo_tables_parse_with_the_workbooks_pairs_by_default(tmp_path: Path) -> None:
    exp = F.load(str(_file(tmp_path, '[[slo]]\nid = "chat"\nobjective = "99.9%"\n'
                                    'good = { ttft = "<= 200ms", e2e = "<= 1s" }\n')))  # fmt: skip
    (s,) = exp.slos
    assert s.id == "chat" and s.objective == pytest.approx(0.999)
    assert s.budget == pytest.approx(0.001)
    assert [(a.long, a.short, a.factor) for a in s.alerts] == [(12, 1, 14.4), (72, 6, 6)]
    assert s.good.ttft is not None and s.good.e2e is not None and s.good.itl is None
    exp = F.load(str(_file(tmp_path, '[[slo]]\nid = "a"\nobjective = 0.95\n'
                                    'windows = [{ long = "10s", short = "2s", factor = 5 }]\n'
                                    '[[slo]]\nid = "b"\nobjective = "95%"\n')))  # fmt: skip
    assert [s.id for s in exp.slos] == ["a", "b"]
    assert exp.slos[0].alerts == (burn.Alert(10, 2, 5),)


@pytest.mark.parametrize(
    "slo, words",
    [
        ('[[slo]]\nobjective = "99%"\n', "slo[0].id: missing"),
        ('[[slo]]\nid = "a"\n', "slo[0].objective: missing"),
        ('[[slo]]\nid = "a"\nobjective = "100%"\n', "slo[0].objective: '100%'"),
        ('[[slo]]\nid = "a"\nobjective = 1.5\n', "give the share of good requests"),
        ('[[slo]]\nid = "A b"\nobjective = 0.99\n', "slo[0].id: 'A b'"),
        ('[[slo]]\nid = "a"\nobjective = 0.99\n[[slo]]\nid = "a"\nobjective = 0.99\n',
         "slo[1].id: 'a' is given twice"),
        ('[[slo]]\nid = "a"\nobjective = 0.99\nbudget = 1\n', "budget"),
        ('[[slo]]\nid = "a"\nobjective = 0.99\ngood = { p99 = "<= 1s" }\n', "p99"),
        ('[[slo]]\nid = "a"\nobjective = 0.99\ngood = { e2e = "fast" }\n', "slo[0].good.e2e"),
        ('[[slo]]\nid = "a"\nobjective = 0.99\nwindows = []\n', "slo[0].windows"),
        ('[[slo]]\nid = "a"\nobjective = 0.99\nwindows = [{ long = "1s", short = "2s", '
         'factor = 2 }]\n', "slo[0].windows[0].long: 1s"),
        ('[[slo]]\nid = "a"\nobjective = 0.99\nwindows = [{ long = "5s", short = "500ms", '
         'factor = 2 }]\n', "slo[0].windows[0].short: 0.5s: give whole seconds"),
        ('[[slo]]\nid = "a"\nobjective = 0.99\nwindows = [{ long = "5s", short = "1s", '
         'factor = 140 }]\n', "140 can never fire"),
        ('[[slo]]\nid = "a"\nobjective = 0.9\n', "slo[0].objective: with a 0.1 error budget"),
        ('[[slo]]\nid = "a"\nobjective = 0.99\nwindows = [{ long = "5s", short = "1s" }]\n',
         "factor: missing"),
    ],
)  # fmt: skip
def test_bad_slo_tables_are_one_line(tmp_path: Path, slo: str, words: str) -> None:
    with pytest.raises(ExperimentError) as e:
        F.load(str(_file(tmp_path, slo)))
    msg = str(e.value)
    assert words in msg and "\n" not in msg, msg


def test_a_streamed_bound_needs_a_streamed_load_and_an_slo_needs_a_load(tmp_path: Path) -> None:
    with pytest.raises(ExperimentError, match=r"slo\[0\].good: token timings need a streamed"):
        F.load(
            str(
                _file(
                    tmp_path,
                    '[[slo]]\nid = "a"\nobjective = 0.99\ngood = { itl = "<= 30ms" }\n',
                    BASE.replace("stream = true", "stream = false"),
                )
            )
        )
    no_load = BASE.replace("[load]\nrate = 10.0\nstream = true\n", "")
    with pytest.raises(ExperimentError, match="slo: burn-rate SLOs count the load's requests"):
        F.load(str(_file(tmp_path, '[[slo]]\nid = "a"\nobjective = 0.99\n', no_load)))


def _samples(bad_by_second: list[int], per_s: int = 10) -> list[Sample]:
    """per_s requests due in each second from t=0; the first bad_by_second[k] of second k fail."""
    out = []
    for k, bad in enumerate(bad_by_second):
        for i in range(per_s):
            due = k + i / per_s
            out.append(Sample(due, due + 0.01, 0.01, 500 if i < bad else 200,
                              "http-500" if i < bad else ""))  # fmt: skip
    return out


def _slo(objective: float = 0.9, *alerts: burn.Alert) -> burn.BurnSLO:
    from pyctl.experiment.model import GoodBounds

    return burn.BurnSLO("s", objective, GoodBounds(), alerts or (burn.Alert(4, 1, 5),))


def test_burn_rate_is_the_bad_share_over_the_budget() -> None:
    slo = _slo(0.9)  # budget 10 %
    wins = burn.count(slo, _samples([0, 0, 2, 5]), 0.0, 4.0)
    assert [(w.total, w.good) for w in wins] == [(10, 10), (10, 10), (10, 8), (10, 5)]
    bs = burn.burns(slo, wins)
    # At 4 s: the long window (4 s) has 7/40 bad = 17.5 % -> 1.75x; the short one 50 % -> 5x.
    assert bs[-1].long_burn == pytest.approx(1.75) and bs[-1].short_burn == pytest.approx(5.0)
    assert not any(b.firing for b in bs)  # 5x is not above 5x, and 1.75x is far from it


def test_a_pair_fires_only_while_both_windows_burn_and_the_short_one_resets_it() -> None:
    slo = _slo(0.9, burn.Alert(4, 1, 3))
    # 2 s of everything failing, then clean.
    wins = burn.count(slo, _samples([0, 10, 10, 0, 0, 0]), 0.0, 6.0)
    fire = [(round(b.at), b.firing) for b in burn.burns(slo, wins)]
    # At 2 s: long 10/20 -> 5x, short 10x: fires; at 3 s: long 20/30 -> 6.7x, short 10x;
    # at 4 s: short 0x -> stops although the long window still holds 20/40 bad (5x).
    assert fire == [(1, False), (2, True), (3, True), (4, False), (5, False), (6, False)]
    # An empty window burns nothing (its emptiness is the load's own finding).
    assert burn.burns(slo, burn.count(slo, [], 0.0, 2.0))[0].long_burn == 0.0


def test_evaluate_fails_on_a_burn_in_the_fault_window_and_errs_on_one_in_the_baseline() -> None:
    slo = _slo(0.9, burn.Alert(2, 1, 3))

    def phase_of(t: float) -> str:
        return "baseline" if t < 2 else ("fault" if t < 4 else "recovery")

    j = burn.evaluate([slo], _samples([0, 0, 8, 8, 0, 0]), 0.0, 6.0, phase_of)
    assert not j.errors and len(j.failures) == 1, j.failures
    assert j.failures[0].startswith("slo s: burn-rate alert 3x 2s/1s fired at +3.0s")
    rows = {(ph, ok) for ph, _sid, ok, *_ in j.hypotheses}
    assert [round(h[-1], 1) for h in j.hypotheses] == [0.0, 8.0, 0.0]  # the nearest pair's burn
    assert rows == {("before", True), ("during", False), ("after", True)}
    assert {sid for _ph, sid, *_ in j.hypotheses} == {"s"}
    j = burn.evaluate([slo], _samples([8, 8, 0, 0]), 0.0, 4.0, phase_of)
    assert j.errors and not j.failures
    assert j.errors[0].startswith("steady state not met before the method: slo s: ")
    assert "fired in the baseline" in j.errors[0]


def test_the_shipped_file_validates() -> None:
    exp = F.load("stream-slo-burn")
    (s,) = exp.slos
    assert s.id == "stream-good" and s.good.itl is not None and exp.expect.verdict == "fail"


def _run(tmp_path: Path, *sets: str) -> tuple[dict[str, object], sqlite3.Connection]:
    db = tmp_path / "gf.db"
    argv = [sys.executable, "-m", "pyctl", "experiment", "run", "stream-slo-burn", "--db",
            str(db), "--json"]  # fmt: skip
    for s in sets:
        argv += ["--set", s]
    for attempt in (1, 2):
        # A burst of other work on this shared machine can break the steady
        # state before the method (verdict error, nothing judged): once more.
        db.unlink(missing_ok=True)
        p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150)
        assert p.stdout, p.stderr
        doc = json.loads(p.stdout)
        if attempt == 2 or "before the method" not in str(doc.get("reason")):
            break
        print(f"retrying (noisy machine): {doc['reason']}")
    return doc, sqlite3.connect(db)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="requires root (BPF, ptrace)")
@pytest.mark.skipif(not paths.DOUBLE_LIBCUDA.exists(), reason="run `make build` (libcuda double)")
def test_a_stall_that_burns_the_budget_fails_and_one_that_does_not_passes(
    tmp_path: Path,
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    doc, c = _run(tmp_path / "a")
    assert doc["verdict"] == "fail", doc
    assert str(doc["reason"]).startswith("slo stream-good: burn-rate alert "), doc["reason"]
    slo = {(x["term"], x["phase"]): x for x in doc["slo"]}  # type: ignore[attr-defined]
    assert slo[("slo.stream-good", "before")]["ok"] and not slo[("slo.stream-good", "during")]["ok"]
    assert slo[("slo.stream-good", "during")]["value"] > 14.4
    rows = {
        (ph, ok, sid)
        for ph, ok, sid in c.execute(
            "SELECT phase, ok, slo_id FROM hypothesis_results WHERE probe = 'slo.stream-good'"
        )
    }
    assert ("before", 1, "stream-good") in rows and ("during", 0, "stream-good") in rows, rows
    # The file's own slo_id on its steady-state rows.
    assert c.execute("SELECT DISTINCT slo_id FROM hypothesis_results WHERE probe LIKE "
                     "'load.%'").fetchall() == [("stream-good-99",)]  # fmt: skip
    fired = c.execute("SELECT DISTINCT phase FROM slo_burns WHERE firing").fetchall()
    assert ("fault",) in fired and ("baseline",) not in fired, fired
    # The windows' streamed terms are stored: the stall shows in the fault's ITL p99.
    itl = dict(c.execute("SELECT phase, max(itl_p99) FROM load_windows GROUP BY phase"))
    assert itl["fault"] > 0.03 > itl["baseline"], itl
    c.close()
    # The same file with a 1 ms stall (it fires, nothing goes bad): pass, the
    # file expected fail, so the run says so (exit 1) and the verdict is pass.
    doc, c = _run(tmp_path / "b", "stall=1ms", "itl=50ms")
    assert doc["verdict"] == "pass", doc
    assert not c.execute("SELECT count(*) FROM slo_burns WHERE firing").fetchone()[0]
    assert c.execute("SELECT sum(fires) FROM experiment_steps").fetchone()[0] > 0
    c.close()


def test_a_steps_thread_is_named_as_the_target_names_it() -> None:
    # What run.py records when a step with a tid arms: the thread's own
    # comm (prctl PR_SET_NAME here, as a server names its workers), not ours.
    import ctypes
    import threading

    from pyctl.experiment.run import thread_name

    libc = ctypes.CDLL(None, use_errno=True)
    named, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def worker() -> None:
        libc.prctl(15, b"gf-decode-7", 0, 0, 0)  # PR_SET_NAME
        tid.append(threading.get_native_id())
        named.set()
        done.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert named.wait(10)
        assert thread_name(os.getpid(), tid[0]) == "gf-decode-7"
        assert thread_name(None, tid[0]) == "gf-decode-7"  # /proc/TID/task/TID too
    finally:
        done.set()
        t.join()
    # Gone: nothing recorded. (join() returns before the kernel reaps the
    # thread, so its /proc entry may outlive it by a moment.)
    deadline = time.monotonic() + 5
    while thread_name(os.getpid(), tid[0]) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread_name(os.getpid(), tid[0]) is None
    assert thread_name(os.getpid(), None) is None  # no tid: the whole process


def test_the_live_feed_sets_the_burn_while_the_run_goes_and_waits_for_answers() -> None:
    # BurnFeed against a stand-in load and a real /metrics: the latest
    # settled window's burn, nothing from the last `settle` seconds (their
    # requests may still be in flight), and the live firing gauge.
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from pyctl.experiment.burn_feed import BurnFeed
    from pyctl.observe.metrics import Metrics

    class Load:
        def __init__(self, samples: list[Sample]) -> None:
            self._s = samples

        def samples(self, since: float, until: float) -> list[Sample]:
            return [s for s in self._s if since <= s.due < until]

    slo = _slo(0.9, burn.Alert(2, 1, 3))
    with Metrics.start("127.0.0.1:0", experiment="b", slo_id="file") as m:
        m.set_run("x00000b0b")
        feed = BurnFeed([slo], Load(_samples([0, 0, 8, 8, 0, 0])), m, lambda: 0.0,
                        lambda t: "fault", settle=1.0)  # fmt: skip
        assert feed.look(0.5) == []  # nothing settled yet
        (b,) = feed.look(4.0)  # windows [0, 3): the one ending at 3 s is the latest
        assert b.at == 3.0 and b.firing and b.short_burn == pytest.approx(8.0)
        (b,) = feed.look(7.0)  # at 6 s: clean again
        assert not b.firing
        with urllib.request.urlopen(m.url, timeout=5) as r:
            text = r.read().decode()
    got = {(s.name, s.labels.get("window")): (s.value, s.labels)
           for f in text_string_to_metric_families(text) for s in f.samples
           if s.name.startswith(("gpufault_experiment_slo_burn_rate_now",
                                 "gpufault_experiment_slo_alert_firing"))}  # fmt: skip
    assert got[("gpufault_experiment_slo_alert_firing", None)][0] == 0
    value, lab = got[("gpufault_experiment_slo_burn_rate_now", "long")]
    assert value == pytest.approx(0.0) and lab["slo_id"] == "s" and lab["run"] == "x00000b0b"
