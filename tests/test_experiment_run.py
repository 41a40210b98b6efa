"""Experiments end to end on the CPU (root: real BPF, ptrace): the issue's
acceptance list. Each runs `gpufault experiment run` as a process against
the reference service it starts itself, and checks the verdict, the exit
status and the evidence in SQLite.

- control (no fault) passes;
- tokenizer-stall fails the p99 hypothesis; recovery is measured after it;
  the remediation hook runs once on the breach and its times are recorded;
- cuda-oom-degrade: degradation_worked, alert_fired, recovered_within;
- worker-hang-abort: the guard aborts, every fault stopped within 1 s;
- Ctrl-C in the method: aborted, faults stopped, rollbacks ran;
- bad targets (unreachable URL, a pid that is not running): exit 2, one
  line naming file and key, nothing armed, no experiment rows.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import bpf_prog_holders
from procio import finish, lines_until

from pyctl import paths
from pyctl.experiment import load as F

pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="requires root (BPF, ptrace)"),
]
needs_double = pytest.mark.skipif(
    not paths.DOUBLE_LIBCUDA.exists(), reason="run `make build` (the libcuda test double)"
)
REPO = Path(__file__).resolve().parent.parent
# `gpufault experiment`, through the CLI's one error contract.
GF_EXP = [sys.executable, "-m", "pyctl", "experiment"]


NOISY_BEFORE = ("steady state not met before the method",)


def run_exp(
    *args: str, timeout: float = 180, retry_on: tuple[str, ...] = NOISY_BEFORE
) -> tuple[int, str, float]:
    """`gpufault experiment run ARGS`. On this shared 2-core machine another
    engineer's burst can break the steady state before the method; the
    experiment then says so (error, nothing armed) and is run once more.
    (A control experiment also gets one more run when it fails: a burst of
    more than a second in its method window; twice is a real failure.)"""
    t = time.monotonic()
    for attempt in (1, 2):
        p = subprocess.run(
            [*GF_EXP, "run", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
        )
        out = p.stdout + p.stderr
        if not (attempt == 1 and any(r in out for r in retry_on)):
            break
        print(f"retrying (noisy machine): {out.strip().splitlines()[-1]}")
    return p.returncode, out, time.monotonic() - t


def gf_progs() -> set[int]:
    """Ids of the gpufault engine programs loaded now (gf_*)."""
    import json

    out = subprocess.run(["bpftool", "prog", "show", "-j"], capture_output=True, text=True)
    return {
        int(p["id"])
        for p in json.loads(out.stdout or "[]")
        if str(p.get("name", "")).startswith("gf_")
    }


def ours_left(db: Path, before: set[int], timeout: float = 10.0) -> list[str]:
    """What this test's experiment left: processes whose command line names
    its database, and gf_ programs loaded since `before` that one of them
    holds or that nobody holds (a leak: the kernel frees an unheld program
    after an RCU grace period, so that is awaited). A plain count of gf_
    programs would also see other engineers' runs on this machine."""

    def mine(pid: int) -> bool:
        try:
            return str(db).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    deadline = time.monotonic() + timeout
    while True:
        left = [f"process {d}" for d in os.listdir("/proc") if d.isdigit() and mine(int(d))]
        held = bpf_prog_holders()
        for pid in gf_progs() - before:
            who = held.get(pid, set())
            if not who or any(mine(h) for h in who):
                left.append(f"program {pid} held by {sorted(who) or 'nobody'}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)  # a kernel free after RCU: no event to wait on


def q(db: Path, sql: str, *params: object) -> list[tuple]:
    c = sqlite3.connect(db)
    try:
        return c.execute(sql, params).fetchall()
    finally:
        c.close()


def one(db: Path, sql: str, *params: object) -> tuple:
    rows = q(db, sql, *params)
    assert len(rows) == 1, rows
    return rows[0]


def copy_with(tmp_path: Path, name: str, extra: str, replace: tuple[str, str] = ("", "")) -> Path:
    text = F.find(name).read_text()
    if replace[0]:
        assert replace[0] in text
        text = text.replace(*replace)
    p = tmp_path / f"{name}.toml"
    p.write_text(text + "\n" + extra)
    return p


def test_control_passes(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    rc, out, took = run_exp("control", "--db", str(db), retry_on=(*NOISY_BEFORE, "verdict FAIL"))
    assert rc == 0, out
    assert "verdict PASS" in out and str(db) in out, out
    xid, verdict, t0, t1 = one(
        db, "SELECT id, verdict, started_at, ended_at FROM experiments WHERE verdict = 'pass'"
    )
    assert verdict == "pass"
    assert f"gpufault experiment results {xid}" in out
    assert q(db, "SELECT count(*) FROM experiment_steps") == [(0,)]
    phases = dict(
        q(db, "SELECT phase, count(*) FROM load_windows WHERE experiment_id=? GROUP BY phase", xid)
    )
    assert phases.get("baseline", 0) >= 3 and phases.get("fault", 0) >= 3, phases
    (worse,) = one(
        db, "SELECT worse FROM judgements WHERE metric='latency' AND experiment_id=?", xid
    )
    assert worse == 0
    bad = q(
        db, "SELECT phase, probe, value FROM hypothesis_results WHERE ok=0 AND experiment_id=?", xid
    )
    assert not bad
    print(f"control: {t1 - t0:.1f}s of experiment, {took:.1f}s with the service's start")


def test_a_command_target_with_a_ready_file(tmp_path: Path) -> None:
    """target.command: gpufault starts it, waits for its ready line, reads
    its ready file ({ready_file}: a private path), stops it at the end."""
    db = tmp_path / "gf.db"
    f = copy_with(
        tmp_path,
        "control",
        "",
        (
            'service = { device = "cpu", args = ["--batch-wait", "0"] }',
            f'command = ["{sys.executable}", "-m", "pyctl.service", "--port", "0", '
            '"--batch-wait", "0", "--ready-file", "{ready_file}"]',
        ),
    )
    rc, out, _ = run_exp(str(f), "--db", str(db), retry_on=(*NOISY_BEFORE, "verdict FAIL"))
    assert rc == 0, out
    assert "target stopped (exit status 0)" in out, out
    assert not [p for p in Path("/tmp").glob("gpufault-exp-*")]


def test_tokenizer_stall_fails_p99_recovers_and_remediates(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    marker = tmp_path / "remedied"
    f = copy_with(
        tmp_path,
        "tokenizer-stall",
        f'[remediation]\ncommand = ["touch", "{marker}"]\non = "breach"\n',
    )
    rc, out, took = run_exp(str(f), "--db", str(db))
    assert rc == 0, out  # the fail is the file's [expect] verdict
    assert "verdict FAIL (expected)" in out and "load.p99" in out, out
    xid, t0 = one(db, "SELECT id, started_at FROM experiments WHERE verdict='fail'")
    ok, value = one(
        db,
        "SELECT ok, value FROM hypothesis_results "
        "WHERE phase='during' AND probe='load.p99' AND experiment_id=?",
        xid,
    )
    assert ok == 0 and value.endswith("ms") and float(value[:-2]) > 50, value
    (worse,) = one(
        db, "SELECT worse FROM judgements WHERE metric='latency' AND experiment_id=?", xid
    )
    assert worse == 1
    status, run_id, fires, armed, ended = one(
        db,
        "SELECT status, run_id, fires, started_at, ended_at FROM experiment_steps "
        "WHERE experiment_id=?",
        xid,
    )
    assert status == "done" and fires >= 3 and ended - armed >= 5.5, (status, fires)
    # The fires are the fault rows of the step's run.
    assert q(db, "SELECT count(*) FROM faults WHERE run_id=?", run_id) == [(fires,)]
    # Recovery time, measured after the fault ended (1 s load windows).
    ok, rt, detail = one(
        db,
        "SELECT ok, value, detail FROM expectations "
        "WHERE name='recovered_within' AND experiment_id=?",
        xid,
    )
    assert ok == 1 and rt is not None and 0 <= rt <= 5, detail
    # The remediation ran once, on the breach, during the fault.
    cmd, r0, r1, rrc = one(
        db, "SELECT command, started_at, ended_at, rc FROM remediations WHERE experiment_id=?", xid
    )
    assert rrc == 0 and marker.exists() and armed <= r0 <= r1 <= ended + 3, (r0, armed, ended)
    # gpufault show names the experiment.
    fid = q(db, "SELECT fault_id FROM faults WHERE run_id=? LIMIT 1", run_id)[0][0]
    show = subprocess.run(
        [sys.executable, "-m", "pyctl", "show", fid, "--db", str(db)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert show.returncode == 0 and f"experiment {xid} tokenizer-stall@v1 step 1" in show.stdout
    res = subprocess.run(
        [*GF_EXP, "results", xid, "--db", str(db)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and f"fault {fid}" in res.stdout, res.stdout + res.stderr
    print(
        f"tokenizer-stall: armed {armed - t0:.2f}s after the start, p99 {value} during, "
        f"recovered {rt:.2f}s after the fault, remediation after {r0 - armed:.2f}s "
        f"({took:.1f}s in all)"
    )


def test_the_default_judge_fails_a_stall_that_a_loose_bound_lets_pass(tmp_path: Path) -> None:
    """Issue 23: "a 10x p99 increase under a loose bound passes silently"
    while the judge was opt-in. tokenizer-stall with its judge line taken
    out (the default judge) and a p99 bound of 10 s: the stall must fail
    it by the judge alone, and the stored file names the judge's alpha."""
    db = tmp_path / "gf.db"
    f = copy_with(tmp_path, "tokenizer-stall", "", ("judge = { alpha = 0.01 }\n", ""))
    rc, out, _ = run_exp(str(f), "--db", str(db), "--set", "p99=10s")
    assert rc == 0 and "verdict FAIL (expected)" in out, out
    assert "latency worse in the fault window than the baseline: worse" in out, out
    xid, settings = one(db, "SELECT id, settings FROM experiments WHERE verdict='fail'")
    assert json.loads(settings)["file"]["steady_state"]["judge"] == {
        "alpha": 0.01, "min_ratio": 1.1
    }  # fmt: skip
    (reason,) = one(db, "SELECT reason FROM judgements WHERE experiment_id=?", xid)
    assert "vs 11 before+after blocks of 1s" in reason, reason
    assert not q(
        db, "SELECT probe FROM hypothesis_results WHERE ok=0 AND probe='load.p99' "
        "AND experiment_id=?", xid
    )  # fmt: skip


@needs_double
def test_cuda_oom_degradation_works_and_recovers(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    rc, out, took = run_exp("cuda-oom-degrade", "--db", str(db))
    assert rc == 0, out
    (xid,) = one(db, "SELECT id FROM experiments WHERE verdict='pass'")
    exp = dict(
        (n, (ok, v, d))
        for n, ok, v, d in q(
            db, "SELECT name, ok, value, detail FROM expectations WHERE experiment_id=?", xid
        )
    )
    assert exp["degradation_worked"][0] == 1, exp
    assert exp["alert_fired"][0] == 1 and exp["alert_fired"][1] <= 3, exp
    assert exp["recovered_within"][0] == 1 and exp["recovered_within"][1] <= 5, exp
    status, fires, tpl = one(
        db, "SELECT status, fires, template FROM experiment_steps WHERE experiment_id=?", xid
    )
    assert status == "done" and fires >= 3 and tpl == "cuda-oom-sticky@v1"
    # No request failed: the fallback answered while the breaker was open.
    (errs,) = one(db, "SELECT max(error_rate) FROM load_windows WHERE experiment_id=?", xid)
    assert errs == 0
    print(
        f"cuda-oom-degrade: alert {exp['alert_fired'][1]:.2f}s after the first fire, "
        f"recovered {exp['recovered_within'][1]:.2f}s after the fault ({took:.1f}s)"
    )


@needs_double
def test_worker_hang_is_aborted_and_every_fault_stops_within_a_second(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    marker = tmp_path / "rolled-back"
    f = copy_with(
        tmp_path,
        "worker-hang-abort",
        f'[[rollback]]\nname = "mark"\ncommand = ["touch", "{marker}"]\n',
    )
    before = gf_progs()
    rc, out, took = run_exp(str(f), "--db", str(db))
    assert rc == 0, out  # aborted by its guard is the file's [expect] verdict
    assert "verdict ABORTED (expected)" in out and "guard probe health" in out, out
    (abort_at,) = one(db, "SELECT at FROM probe_samples WHERE probe='abort:health'")
    status, armed, ended, fires = one(
        db, "SELECT status, started_at, ended_at, fires FROM experiment_steps"
    )
    assert status == "stopped" and fires == 1
    stop_s = ended - abort_at
    assert 0 <= stop_s < 1.0, stop_s  # the step's run row closed within 1 s
    (run_status,) = one(
        db, "SELECT r.status FROM runs r JOIN experiment_steps s ON s.run_id = r.run_id"
    )
    assert run_status == "done"
    assert marker.exists()  # the rollback ran on abort
    assert q(db, "SELECT ok FROM probe_samples WHERE probe='rollback:mark'") == [(1,)]
    assert not (left := ours_left(db, before)), left
    print(
        f"worker-hang-abort: guard aborted {abort_at - armed:.2f}s after arming, fault "
        f"stopped {stop_s * 1000:.0f} ms after the abort ({took:.1f}s in all)"
    )


def _run_until_armed(*args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """`gpufault experiment run ARGS`, stderr merged into stdout, returned
    once a step armed, with the lines up to and including that one."""
    p = subprocess.Popen(
        [*GF_EXP, "run", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        return p, lines_until(p.stdout, ": armed (run")
    except BaseException:  # ended first, or the test was interrupted: leave nothing running
        p.kill()
        p.wait()
        raise


def test_ctrl_c_in_the_method_stops_faults_and_rolls_back(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    marker = tmp_path / "rolled-back"
    f = copy_with(tmp_path, "tokenizer-stall", f'[[rollback]]\ncommand = ["touch", "{marker}"]\n')
    before = gf_progs()
    p, seen = _run_until_armed(str(f), "--db", str(db), "--set", "duration=60s")
    try:
        t = time.time()
        p.send_signal(signal.SIGINT)
        rest, _ = finish(p, 60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 3, "".join(seen) + rest
    assert "interrupted by SIGINT" in rest
    status, ended = one(db, "SELECT status, ended_at FROM experiment_steps")
    assert status == "stopped" and ended - t < 1.0, (status, ended - t)
    assert marker.exists()
    assert one(db, "SELECT verdict FROM experiments") == ("aborted",)
    assert not (left := ours_left(db, before)), left


def test_sigkill_of_the_runner_stops_its_faults_and_its_service(tmp_path: Path) -> None:
    """docs/experiments.md, "What survives a SIGKILL": the children get
    SIGTERM from the kernel (PR_SET_PDEATHSIG) and stop as on Ctrl-C; the
    experiment row stays "running" (an honest trace)."""
    db = tmp_path / "gf.db"
    before = gf_progs()
    p, _ = _run_until_armed("tokenizer-stall", "--db", str(db), "--set", "duration=60s")
    try:
        p.kill()
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not (left := ours_left(db, before)), left  # its fault controller is gone

    def started_by_it() -> list[int]:  # the service: argv `python -c BOOT RUNNER_PID ...`
        out = []
        for d in filter(str.isdigit, os.listdir("/proc")):
            try:
                argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[1:2] == [b"-c"] and argv[3:4] == [str(p.pid).encode()]:
                out.append(int(d))
        return out

    deadline = time.monotonic() + 20
    while started_by_it() and time.monotonic() < deadline:
        time.sleep(0.1)  # its SIGTERM handling: no event to wait on from here
    assert not started_by_it()
    (status,) = one(db, "SELECT status FROM runs")
    assert status == "done"  # the child closed its run row itself
    assert one(db, "SELECT verdict FROM experiments") == ("running",)


def test_bad_targets_exit_2_and_arm_nothing(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    before = gf_progs()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        # A running pid, but nothing listens at the url.
        f = tmp_path / "unreachable.toml"
        f.write_text(
            F.find("tokenizer-stall")
            .read_text()
            .replace(
                'service = { device = "cpu", args = ["--batch-wait", "0"] }',
                f'url = "http://127.0.0.1:9"\npid = {sleeper.pid}',
            )
        )
        rc, out, _ = run_exp(str(f), "--db", str(db))
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1, out
        assert str(f) in lines[0] and "target.url" in lines[0] and "unreachable" in lines[0]
    finally:
        sleeper.kill()
        sleeper.wait()
    # A pid that is not running (reaped above), with a URL that answers.
    import http.server
    import threading

    srv = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        f2 = tmp_path / "gone.toml"
        f2.write_text(
            f.read_text().replace("http://127.0.0.1:9", f"http://127.0.0.1:{srv.server_port}")
        )
        rc, out, _ = run_exp(str(f2), "--db", str(db))
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert rc == 2 and len(lines) == 1, out
        assert str(f2) in lines[0] and "target.pid" in lines[0] and str(sleeper.pid) in lines[0]
    finally:
        srv.shutdown()
        srv.server_close()
    assert not db.exists()  # no experiment rows: not even a database
    assert not (left := ours_left(db, before)), left


def test_a_pid_target_that_dies_in_the_window_is_the_verdicts_first_reason(
    tmp_path: Path,
) -> None:
    """target.pid (a service gpufault did not start) killed by SIGABRT while
    the tokenizer stall is armed: the verdict's reason says so first, with
    the signal the step's engine recorded (links, kind exit) and when."""
    from service_proc import ServiceProc

    db = tmp_path / "gf.db"
    svc = ServiceProc("--batch-wait", "0")
    try:
        f = tmp_path / "pid-target.toml"
        text = (
            F.find("tokenizer-stall")
            .read_text()
            .replace(
                'service = { device = "cpu", args = ["--batch-wait", "0"] }',
                f'url = "{svc.url}"\npid = {svc.pid}',
            )
            .replace('baseline = "8s"', 'baseline = "2s"')
            .replace('prob = "{share}"', 'prob = "100%"')  # the first encode fires
            .replace('recovery = "9s"', 'recovery = "4s"')
        )
        f.write_text(text)
        p = subprocess.Popen(
            [
                *GF_EXP,
                "run",
                str(f),
                "--db",
                str(db),
                "--set",
                "duration=6s",
                "--set",
                "p99=2s",
                "--set",
                "recover=1s",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert p.stdout is not None
        seen = lines_until(p.stdout, ": armed (run ")
        run = seen[-1].split(": armed (run ", 1)[1].split(",")[0]
        # Once the stall has fired (its fault row is in): the death is then
        # the fault window's, not a step that never fired.
        t = time.monotonic()
        while time.monotonic() - t < 30:
            try:
                if q(db, "SELECT count(*) FROM faults WHERE run_id = ?", run)[0][0]:
                    break
            except sqlite3.Error:
                pass  # the table is created by the step's first transaction
            time.sleep(0.05)  # the engine's writes have no event a test can wait on
        svc.proc.send_signal(signal.SIGABRT)  # an abort in the armed window
        out = "".join(seen) + finish(p, timeout=90)[0]
    finally:
        svc.close()
    # tokenizer-stall expects a fail, but not a crash: a death the file
    # does not allow (target_may_die) is a surprise, exit 1.
    assert p.returncode == 1, out
    assert "verdict FAIL (expected FAIL: a surprise)" in out, out
    (reason,) = one(db, "SELECT reason FROM experiments")
    assert reason.startswith(
        f"the target (pid {svc.pid}) died during the experiment (killed by SIGABRT"
    ), reason
    assert "during the fault window" in reason, reason
    assert reason in out
    print(reason)
