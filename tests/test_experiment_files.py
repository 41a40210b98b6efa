"""Experiment files, verdicts, evidence and the CLI, without a service (anyone).

The end-to-end runs against the real service are in test_experiment_run.py.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from pyctl.api.faults import spec_from_json
from pyctl.cli.experiment import experiment
from pyctl.experiment import evidence as E
from pyctl.experiment import load as F
from pyctl.experiment import model as M
from pyctl.experiment.steps.fault import LocalFaultHost, StepRequest
from pyctl.experiment.verdict import Findings, Verdict, decide
from pyctl.spec import FaultSpec

SHIPPED = ["control", "tokenizer-stall", "cuda-oom-degrade", "worker-hang-abort"]

GOOD = """
name = "mine"
version = 2
title = "a test experiment"
[knobs.stall]
default = "20ms"
help = "stall"
[target]
url = "http://127.0.0.1:9"
pid = 4242
[load]
rate = 5
[steady_state]
p99 = "<= 100ms"
[[method]]
fault = { lib = "tokenizers", fn = "tok:hf-encode", action = "stall", stall = "{stall}", every = 5 }
duration = "3s"
[[method]]
template = "cuda-oom-sticky"
set = { after = 4 }
duration = "2s"
parallel = true
"""


def write(tmp_path: Path, text: str, name: str = "mine.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_experiments_load(name: str) -> None:
    e = F.load(name)
    assert e.name == name and e.version >= 1 and e.title
    assert e.path.parent == F.SHIPPED
    if name == "control":
        assert not e.steps
    else:
        assert e.steps and all(s.specs for s in e.steps)


def test_good_file_steps_offsets_knobs_and_sets(tmp_path: Path) -> None:
    e = F.load(str(write(tmp_path, GOOD)), {"stall": "30ms"})
    a, b = e.steps
    assert a.template is None and a.fault is not None and a.fault["stall"] == "30ms"
    assert a.specs[0].stall_ms == 30 and a.specs[0].every == 5
    assert (a.start, a.duration) == (0.0, 3.0)
    assert b.template == "cuda-oom-sticky@v1" and b.sets == {"after": "4"}
    assert b.start == 0.0  # parallel: with the step before
    assert b.specs[0].after == 4 and b.specs[0].sticky
    assert e.method_window == 3.0 and e.values == {"stall": "30ms"}
    assert e.expanded["method"][0]["fault"]["stall"] == "30ms"


def test_sequence_is_the_default(tmp_path: Path) -> None:
    e = F.load(str(write(tmp_path, GOOD.replace("parallel = true", ""))))
    assert [(s.start, s.duration) for s in e.steps] == [(0.0, 3.0), (3.0, 2.0)]
    assert e.method_window == 5.0


@pytest.mark.parametrize(
    ("edit", "key", "what"),
    [
        (("rate = 5", "rate = 5\nburst = 3"), "load.burst", "unknown key"),
        (("[target]", "colour = 'red'\n[target]"), "colour", "unknown key"),
        (("rate = 5", 'rate = "fast"'), "load.rate", "expected a number"),
        (("version = 2", 'version = "2"'), "version", "expected an integer"),
        (('duration = "3s"', "duration = true"), "method[1].duration", "expected a duration"),
        (('duration = "3s"', 'duration = "3 parsecs"'), "method[1].duration", "not a duration"),
        (('"cuda-oom-sticky"', '"no-such-template"'), "method[2].template", "no template"),
        (("every = 5", "every = 5, colour = 1"), "method[1].fault.colour", "unknown field"),
        (('p99 = "<= 100ms"', 'p99 = "about 100ms"'), "steady_state.p99", "not a comparison"),
        (('"{stall}"', '"{stal}"'), "method", "neither a knob"),
        (("pid = 4242", "pid = 4242\ncommand = ['x']"), "target", "keep one"),
    ],
)
def test_bad_files_are_one_line_naming_file_and_key(
    tmp_path: Path, edit: tuple[str, str], key: str, what: str
) -> None:
    assert edit[0] in GOOD
    p = write(tmp_path, GOOD.replace(edit[0], edit[1], 1))
    with pytest.raises(M.ExperimentError) as ei:
        F.load(str(p))
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"{p}: ") and key in msg and what in msg, msg


def test_unknown_knob_in_set_and_wrong_type(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD)
    with pytest.raises(M.ExperimentError, match=r"--set nope: no such knob"):
        F.load(str(p), {"nope": "1"})
    with pytest.raises(M.ExperimentError, match=r"stall"):
        F.load(str(p), {"stall": "0ms"})  # the fault refuses a zero stall


def test_probe_errors_name_the_key(tmp_path: Path) -> None:
    text = GOOD + '\n[probes.h]\nkind = "http"\nurl = "{url}/health"\ncolour = 1\n'
    with pytest.raises(M.ExperimentError) as ei:
        F.load(str(write(tmp_path, text)))
    assert "probes.h" in str(ei.value) and "colour" in str(ei.value)
    # An abort guard must be sampled while the faults run.
    text = (
        GOOD + '\n[probes.h]\nkind = "http"\nmode = "sot"\nurl = "{url}/health"\n'
        '[[abort]]\nprobe = "h"\n'
    )
    with pytest.raises(M.ExperimentError, match=r"abort\[1\]\.probe: .*continuous"):
        F.load(str(write(tmp_path, text)))


def test_name_lookup_and_env_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "exps"
    d.mkdir()
    (d / "control.toml").write_text(GOOD.replace('name = "mine"', 'name = "control"'))
    monkeypatch.setenv("GPUFAULT_EXPERIMENTS", str(d))
    assert F.load("control").path == d / "control.toml"  # the env dir wins
    with pytest.raises(M.ExperimentError, match="version: is 2, not 1"):
        F.load("control@v1")
    with pytest.raises(M.ExperimentError, match="no experiment 'nope'"):
        F.load("nope")


@pytest.mark.parametrize(
    "fault",
    [
        {
            "lib": "tokenizers",
            "fn": "tok:hf-encode",
            "action": "stall",
            "stall": "50ms",
            "prob": "20%",
        },
        {"lib": "libcuda", "fn": "cuCtxSynchronize", "action": "stall", "nth": 1},
        {
            "lib": "libcuda",
            "fn": "cuMemAlloc_v2",
            "action": "fail",
            "ret": "CUDA_ERROR_OUT_OF_MEMORY",
            "after": 2,
            "sticky": True,
            "when": "arg2>=1M",
        },
        {
            "lib": "libc",
            "fn": ["read", "write"],
            "action": "signal",
            "signal": "SIGSEGV",
            "every": 7,
            "max": 2,
            "caller": "main",
            "window": "1s",
        },
    ],
)
def test_inline_fault_reaches_the_child_as_the_same_spec(fault: dict) -> None:
    """The recorded spec (from the table) is the one the child arms: the
    step's FaultSpec goes to it as JSON (pyctl/api/child.py), and reading
    that JSON back gives the spec unchanged, every field."""
    spec = FaultSpec.from_fields(dict(fault))
    wire = json.loads(json.dumps(spec.to_json()))
    assert spec_from_json(wire) == spec


def test_step_session_for_template_and_inline_steps(tmp_path: Path) -> None:
    """A step becomes a library session: its specs as they are, its
    target, its duration (the kernel deadline) and its run row's kind; no
    command line is built from it."""
    h = LocalFaultHost(str(tmp_path / "gf.db"))
    spec = FaultSpec.from_fields({"lib": "libcuda", "fn": "cuMemAlloc_v2"})
    t = StepRequest(0, "oom", "cuda-oom-sticky@v1", {"after": "3"}, None, [spec], 6.0, 99)
    s = h.session(t)
    assert s.specs == [spec]
    assert (s.target.pid, s.target.tid) == (99, None)
    assert (s.settings.db, s.settings.duration) == (str(tmp_path / "gf.db"), 6.0)
    assert s.settings.kind == "template:cuda-oom-sticky@v1"
    i = StepRequest(
        1, "hang", None, {},
        {"lib": "libcuda", "fn": "cuCtxSynchronize", "action": "stall", "nth": 1},
        [spec], 30.0, 99, 100, arm_timeout=120.0,
    )  # fmt: skip
    s = h.session(i)
    assert (s.target.pid, s.target.tid) == (None, 100)
    assert (s.settings.kind, s.settings.arm_timeout) == ("inject", 120.0)


def test_verdict_order() -> None:
    assert decide(Findings()).verdict == "pass"
    assert decide(Findings(failures=["p99"])).exit_code == 1
    assert decide(Findings(abort="guard", failures=["p99"])).verdict == "aborted"
    v = decide(Findings(errors=["step 1 never fired"], abort="guard", failures=["x"]))
    assert (v.verdict, v.exit_code, v.reason) == ("error", 2, "step 1 never fired")


def test_a_dead_target_is_the_first_reason_of_any_verdict() -> None:
    died = "the target (pid 7) died during the experiment (killed by SIGABRT)"
    assert decide(Findings(died=died)) == Verdict("fail", died)
    v = decide(Findings(died=died, failures=["p99", "judge"]))
    assert (v.verdict, v.reason) == ("fail", f"{died}; p99 (+1 more)")
    v = decide(Findings(died=died, abort="guard health"))
    assert (v.verdict, v.reason) == ("aborted", f"{died}; guard health")
    # The step never fired because the target was gone: still said first.
    v = decide(Findings(died=died, errors=["step 1 never fired"]))
    assert (v.verdict, v.reason) == ("error", f"{died}; step 1 never fired")


def test_evidence_rows_in_one_transaction(tmp_path: Path) -> None:
    from pyctl.experiment.loadgen import WindowStats
    from pyctl.experiment.stats import Judgement

    e = F.load("control")
    ev = E.Evidence(tmp_path / "gf.db")
    xid = ev.start(e, "local:test")
    assert xid.startswith("x") and len(xid) == 9 and xid.isalnum()
    c = sqlite3.connect(tmp_path / "gf.db")
    assert c.execute("SELECT verdict FROM experiments").fetchall() == [("running",)]
    rec = E.Record()
    rec.load_windows.append(
        E.LoadWindow(
            WindowStats(1.0, 2.0, 0, float("nan"), float("nan"), float("nan"), float("nan"), 0.0),
            "baseline",
        )
    )
    rec.judgements.append(E.Judged("latency", Judgement(False, 0.5, 0.0, 10, 10, "same")))
    rec.expectations.append(E.Expectation("recovered_within", True, 0.5, "ok"))
    rec.hypotheses.append(E.Hypothesis("before", "load.p99", True, "1.0ms", "<= 2ms", "n"))
    rec.probe_samples.append(E.ProbeSample("healthy", "baseline", 1.5, True, float("nan"), "d"))
    rec.remediations.append(E.RemediationRun("true", 1.0, 2.0, 0))
    ev.finish("pass", "fine", rec)
    ev.close()
    assert c.execute("SELECT verdict, reason FROM experiments").fetchall() == [("pass", "fine")]
    assert c.execute("SELECT count, p99 FROM load_windows").fetchall() == [(0, None)]
    got = c.execute("SELECT phase, probe, ok, value, tolerance FROM hypothesis_results").fetchall()
    assert got == [("before", "load.p99", 1, "1.0ms", "<= 2ms")]
    assert c.execute("SELECT name, ok, value FROM expectations").fetchall() == [
        ("recovered_within", 1, 0.5)
    ]
    assert c.execute("SELECT probe, ok, value FROM probe_samples").fetchall() == [
        ("healthy", 1, None)
    ]
    assert c.execute("SELECT rc FROM remediations").fetchall() == [(0,)]
    settings = json.loads(c.execute("SELECT settings FROM experiments").fetchone()[0])
    assert settings["knobs"] == e.values and settings["file"]["name"] == "control"
    for table, cols in E_TABLES.items():
        got = [r[1] for r in c.execute(f"PRAGMA table_info({table})")]
        assert got == cols, table
    c.close()


E_TABLES = {
    "experiments": [
        "id",
        "name",
        "version",
        "file",
        "slo_id",
        "started_at",
        "ended_at",
        "verdict",
        "reason",
        "settings",
        "host",
    ],
    "experiment_steps": [
        "experiment_id",
        "idx",
        "name",
        "template",
        "spec",
        "run_id",
        "planned_start",
        "planned_duration",
        "started_at",
        "ended_at",
        "fires",
        "status",
        "thread_name",
    ],
    "probe_samples": ["experiment_id", "probe", "phase", "at", "ok", "value", "detail"],
    "load_windows": [
        "experiment_id",
        "start",
        "end",
        "count",
        "p50",
        "p95",
        "p99",
        "error_rate",
        "throughput",
        "phase",
        "ttft_p50",
        "ttft_p95",
        "ttft_p99",
        "itl_p50",
        "itl_p95",
        "itl_p99",
        "output_tokens_per_s",
        "goodput",
    ],
    "hypothesis_results": [
        "experiment_id", "phase", "probe", "ok", "value", "tolerance", "detail", "slo_id",
    ],
    "judgements": [
        "experiment_id",
        "metric",
        "baseline_n",
        "window_n",
        "p_value",
        "effect",
        "worse",
        "reason",
        "slo_id",
    ],
    "expectations": ["experiment_id", "name", "ok", "value", "detail"],
    "remediations": ["experiment_id", "command", "started_at", "ended_at", "rc"],
    "slo_windows": ["experiment_id", "slo_id", "start", "end", "phase", "total", "good"],
    "slo_burns": [
        "experiment_id", "slo_id", "alert", "long_s", "short_s", "factor", "at", "phase",
        "long_burn", "short_burn", "firing",
    ],
}


def test_ddl_constant_has_the_agreed_columns(tmp_path: Path) -> None:
    c = sqlite3.connect(":memory:")
    c.executescript(E.EXPERIMENT_DDL)
    for table, cols in E_TABLES.items():
        assert [r[1] for r in c.execute(f"PRAGMA table_info({table})")] == cols, table


def test_cli_list_show_validate(tmp_path: Path) -> None:
    r = CliRunner().invoke(experiment, ["list"])
    assert r.exit_code == 0 and all(n in r.output for n in SHIPPED), r.output
    r = CliRunner().invoke(experiment, ["show", "tokenizer-stall", "--set", "stall=80ms"])
    assert r.exit_code == 0, r.output
    assert "'80ms'" in r.output and "(default '50ms')" in r.output
    assert "stall 80ms" in r.output and "prob=20%" in r.output  # the spec, in words
    r = CliRunner().invoke(experiment, ["validate", str(write(tmp_path, GOOD))])
    assert r.exit_code == 0 and ": ok (mine@v2, 2 step(s)" in r.output, r.output


def test_cli_bad_file_exits_2_one_line_and_writes_nothing(tmp_path: Path) -> None:
    p = write(tmp_path, GOOD.replace("rate = 5", "rate = 5\nburst = 3"))
    db = tmp_path / "gf.db"
    for cmd in (["validate", str(p)], ["run", str(p), "--db", str(db)]):
        r = CliRunner().invoke(experiment, cmd)
        assert r.exit_code == 2, r.output
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and "load.burst" in lines[0] and str(p) in lines[0], r.output
    assert not db.exists()


def test_gpufault_main_exits_2_for_an_experiment_error(tmp_path: Path) -> None:
    """ExperimentError is one of the user errors of the one error contract."""
    from pyctl import errors

    assert M.ExperimentError in errors.user_error_types()


def test_shipped_files_are_package_data() -> None:
    """The wheel carries pyctl/experiments/*.toml, as it does the templates."""
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    conf = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert "experiments/*.toml" in conf["tool"]["setuptools"]["package-data"]["pyctl"]


def test_cli_refused_db_is_checked_before_the_target_starts(tmp_path: Path) -> None:
    """--db goes through store.open_db first: a symlink is refused (exit 2)
    before any service is started."""
    import time

    link = tmp_path / "gf.db"
    link.symlink_to(tmp_path / "elsewhere.db")
    t = time.monotonic()
    r = CliRunner().invoke(experiment, ["run", "control", "--db", str(link)])
    assert r.exit_code == 2 and "symbolic link" in r.output, r.output
    assert time.monotonic() - t < 3  # the service (3-5 s to start) never ran
    assert not (tmp_path / "elsewhere.db").exists()


def test_runner_reports_phase_faults_active_and_verdict_to_metrics(tmp_path: Path) -> None:
    """The --metrics-addr wiring (docs/observability.md): set_phase at each
    phase, set_faults_active as steps arm and end."""
    from pyctl.experiment.run import Run

    calls: list[tuple[str, object]] = []

    class FakeMetrics:
        def set_phase(self, phase: str) -> None:
            calls.append(("phase", phase))

        def set_faults_active(self, n: int) -> None:
            calls.append(("active", n))

    r = Run(F.load("control"), str(tmp_path / "gf.db"), metrics=FakeMetrics())
    r._set_phase("baseline")
    r._active(+1)
    r._set_phase("fault")
    r._active(-1)
    assert calls == [("phase", "baseline"), ("active", 1), ("phase", "fault"), ("active", 0)]


def test_cli_metrics_addr_in_use_exits_2_before_anything(tmp_path: Path) -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        port = s.getsockname()[1]
        r = CliRunner().invoke(
            experiment,
            [
                "run",
                "control",
                "--db",
                str(tmp_path / "gf.db"),
                "--metrics-addr",
                f"127.0.0.1:{port}",
            ],
        )
    finally:
        s.close()
    assert r.exit_code == 2 and "metrics" in r.output.lower(), r.output
    assert not (tmp_path / "gf.db").exists()


def test_cli_faults_without_root_exit_2_before_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    r = CliRunner().invoke(experiment, ["run", "tokenizer-stall", "--db", str(tmp_path / "g.db")])
    assert r.exit_code == 2 and "method: its faults need root" in r.output, r.output
    assert not (tmp_path / "g.db").exists()


# ---- runner gaps (issue 16) and the per-class files (issue 15) -----------------------------

CLASS_FILES = [
    "cuda-launch-failed-degrade",
    "cuda-ctx-destroyed-degrade",
    "cuda-stream-stall-p99",
    "cuda-oom-leak-held",
    "unicode-adversarial",
    "over-limit-prompts",
    "tokenizer-race",
    "tokenizer-cache-skew",
]


@pytest.mark.parametrize("name", sorted(F.all_names()))
def test_every_shipped_file_loads_and_each_step_is_a_fault_or_traffic(name: str) -> None:
    e = F.load(name)
    assert e.name == name and e.title and e.description
    for s in e.steps:
        # exactly one of: BPF fault specs, a traffic, a perturb or a pressure step
        kinds = [bool(s.specs), *(x is not None for x in (s.traffic, s.perturb, s.pressure))]
        assert kinds.count(True) == 1, s
    for k in e.knobs.values():
        assert k.help


def test_the_class_files_are_shipped_and_in_the_docs_table() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "experiments.md").read_text()
    for name in CLASS_FILES:
        assert name in F.all_names(), name
        assert f"| `{name}` |" in doc, name


STEP = """
name = "steps"
version = 1
title = "t"
[target]
url = "http://127.0.0.1:9"
pid = 4242
[[method]]
fault = { lib = "libcuda", fn = "cuMemAlloc_v2", action = "fail", ret = 2 }
duration = "2s"
EXTRA
"""


def _steps(tmp_path: Path, extra: str) -> M.Experiment:
    return F.load(str(write(tmp_path, STEP.replace("EXTRA", extra))))


def _one_line_refusal(
    load: Callable[[Path, str], M.Experiment], tmp_path: Path, text: str, key: str, what: str
) -> None:
    """load(tmp_path, text) is refused in one line that names key and says what."""
    with pytest.raises(M.ExperimentError) as ei:
        load(tmp_path, text)
    msg = str(ei.value)
    assert "\n" not in msg and key in msg and what in msg, msg


def test_a_step_pid_tid_and_arm_timeout(tmp_path: Path) -> None:
    s = _steps(tmp_path, 'pid = "{rank1_pid}"\narm_timeout = "120s"').steps[0]
    assert (s.pid, s.tid, s.arm_timeout) == ("{rank1_pid}", None, 120.0)
    s = _steps(tmp_path, 'tid = "{rank2_tid}"').steps[0]
    assert s.tid == "{rank2_tid}" and s.arm_timeout is None
    assert _steps(tmp_path, "pid = 1234").steps[0].pid == "1234"
    # rankN facts are known placeholders in probes and commands too
    e = _steps(
        tmp_path,
        '[probes.r1]\nkind = "process"\npid = "{rank1_pid}"\nmode = "continuous"',
    )
    assert "r1" in e.probes


@pytest.mark.parametrize(
    ("extra", "key", "what"),
    [
        ('pid = "{url}"', "method[1].pid", "give a number or one fact"),
        ("pid = 0", "method[1].pid", "not a process id"),
        ('pid = "{rank1_pid} x"', "method[1].pid", "give a number or one fact"),
        ('tid = "{worker_tid}"\nthread = "gf-worker"', "method[1].tid", "keep one"),
        ('arm_timeout = "soon"', "method[1].arm_timeout", "not a duration"),
        ('pid = "{rank_pid}"', "method", "neither a knob"),
    ],
)
def test_bad_step_targets(tmp_path: Path, extra: str, key: str, what: str) -> None:
    _one_line_refusal(_steps, tmp_path, extra, key, what)


TRAFFIC = """
name = "traffic"
version = 1
title = "t"
[target]
url = "http://127.0.0.1:9"
pid = 4242
[[method]]
traffic = { TABLE }
duration = "2s"
"""


def _traffic(tmp_path: Path, table: str) -> M.Experiment:
    return F.load(str(write(tmp_path, TRAFFIC.replace("TABLE", table))))


def test_a_traffic_step(tmp_path: Path) -> None:
    s = _traffic(tmp_path, 'corpus = "unicode", rate = 7, max_bad = "2%"').steps[0]
    t = s.traffic
    assert t is not None and not s.specs and s.label == "traffic"
    assert (t.corpus, t.rate, t.ok_status, t.max_bad) == ("unicode", 7.0, (200, 499), 0.02)
    t2 = _traffic(tmp_path, 'prompts = ["a", "b"], ok_status = [200, 299]').steps[0].traffic
    assert t2 is not None and t2.corpus == "prompts" and t2.ok_status == (200, 299)


@pytest.mark.parametrize(
    ("table", "key", "what"),
    [
        ('corpus = "klingon"', "traffic.corpus", "use one of"),
        ("ok_status = [500, 200]", "traffic.ok_status", "status range"),
        ("ok_status = 200", "traffic.ok_status", "status range"),
        ("max_bad = 1.5", "traffic.max_bad", "share"),
        ('corpus = "prompts"', "traffic.prompts", "needs prompts"),
        ('corpus = "hot", prompts = ["a"]', "traffic.prompts", "are for corpus"),
        ("colour = 1", "traffic.colour", "unknown key"),
    ],
)
def test_bad_traffic_steps(tmp_path: Path, table: str, key: str, what: str) -> None:
    _one_line_refusal(_traffic, tmp_path, table, key, what)


def test_traffic_steps_take_no_process(tmp_path: Path) -> None:
    text = TRAFFIC.replace("TABLE", 'corpus = "hot"').replace(
        'duration = "2s"', 'duration = "2s"\npid = "{rank1_pid}"'
    )
    with pytest.raises(M.ExperimentError, match=r"method\[1\]\.pid: a traffic step"):
        F.load(str(write(tmp_path, text)))


def test_rank_facts_and_step_targets(tmp_path: Path) -> None:
    import os

    from pyctl.experiment import target as T

    info = {"ranks": [{"rank": 0, "pid": 10, "worker_tid": 11}, {"rank": 1, "pid": 20}]}
    assert T.rank_facts(info) == {"rank0_pid": 10, "rank0_tid": 11, "rank1_pid": 20}
    assert T.rank_facts({"ranks": "no"}) == {}
    e = _steps(tmp_path, 'pid = "{rank1_pid}"')
    me = os.getpid()
    assert T.step_target(e, e.steps[0], {"pid": 1, "rank1_pid": me}) == (me, None)
    with pytest.raises(M.ExperimentError, match=r"method\[1\]\.pid: the target has no fact"):
        T.step_target(e, e.steps[0], {"pid": me})
    # a tid gives its process; a tid of another process than the pid is refused
    e = _steps(tmp_path, "tid = " + str(me))
    assert T.step_target(e, e.steps[0], {"pid": 1}) == (me, me)
    e = _steps(tmp_path, f"tid = {me}\npid = 1")
    with pytest.raises(M.ExperimentError, match=r"belongs to pid"):
        T.step_target(e, e.steps[0], {"pid": 1})


def test_the_arm_timeout_reaches_the_host(tmp_path: Path) -> None:
    h = LocalFaultHost(str(tmp_path / "gf.db"), arm_timeout=60.0)
    seen: list[float] = []

    class Fake:
        def __init__(self, t: float | None) -> None:
            self.step = StepRequest(0, "s", None, {}, {}, [], 1.0, 1, arm_timeout=t)

        def wait_armed(self, timeout: float) -> None:
            seen.append(timeout)

    h.armed(Fake(120.0))  # type: ignore[arg-type]
    h.armed(Fake(None))  # type: ignore[arg-type]
    assert seen == [120.0, 60.0]


def test_corpora_are_exact_where_the_class_needs_it() -> None:
    from pyctl.experiment import corpora as C
    from pyctl.service.tokenizer import ServiceTokenizer

    tok = ServiceTokenizer(1000)

    def load(corpus: str) -> M.Load:
        return M.Load(10, "x", 2, 2.0, "/v1/completions", 4, corpus=corpus, max_len=500)

    over = C.cases(load("over-limit"), 10)
    assert over is not None
    room = 256 - 2
    counts = [len(tok.encode(json.loads(b)["prompt"])) for _n, b in over]
    assert counts[: len(C.OVER_BY)] == [room + k for k in C.OVER_BY], counts
    assert counts[-1] >= 2560
    at = C.cases(load("at-limit"), 10)
    assert at is not None and len(tok.encode(json.loads(at[0][1])["prompt"])) == room
    uni = C.cases(load("unicode"), 10)
    assert uni is not None
    names = dict(uni)
    assert b"\\ud800" in names["lone_surrogate/high"]  # a JSON escape
    assert b"\xff\xfe" in names["invalid_utf8/ff-fe"]  # raw bytes in the body
    cold = C.bodies(load("cold"), 50)
    assert cold is not None and len(set(cold)) == 50
    assert C.bodies(load("prompt"), 5) is None


def test_same_as_first_tolerance() -> None:
    from pyctl.experiment.probes import ProbeError, Tolerance

    t = Tolerance.from_toml({"same_as": "first"}, "x")
    assert t.check("abc") and t.check("abc") and not t.check("abd") and not t.check(None)
    assert str(t) == "same as the first sample"
    with pytest.raises(ProbeError, match="same_as"):
        Tolerance.from_toml({"same_as": "last"}, "x")
