"""No child interpreter gpufault starts (as root) imports from the current
directory or from PYTHONPATH (issue 25 item 3, issue 27).

Each test plants a `pyctl/` package and modules named like ones a child
imports (ctypes first of all: the old step boot imported it before
anything else) in the working directory AND in a directory on
PYTHONPATH; each planted module leaves a marker file when it is
imported. gpufault itself is started isolated (paths.module_argv, as its
own children now are), so a marker can only come from a child that is
not. Each test also checks that the child it is about really ran.

The commands that start a Python child: `experiment run` (the target
service and each fault step's controller), `service --ranks 2` (rank 1),
`hooks vram-pressure` / `hooks tc-measure` (the hook module), and
`serve` (a forked controller that enters the client's directory). The
tokenizer commands start none (a `module:callable` target is imported
in-process by name, as the user asked).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pyctl.resident import wire

REPO = Path(__file__).resolve().parent.parent
# What a child might import by a bare name: the package itself, ctypes
# (the old boot's first import), and difflib / concurrent (imported late
# by a served controller, after it entered the client's directory).
PLANTS = ("pyctl/__init__.py", "ctypes.py", "difflib.py", "concurrent/__init__.py")


@dataclass
class Planted:
    cwd: Path  # the working directory the command runs in
    pythonpath: Path  # a directory named by PYTHONPATH
    marks: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(self.pythonpath), **extra}
        env.pop("GPUFAULT_NO_SERVER", None)
        return env

    def imported(self) -> list[str]:
        return sorted(p.name for p in self.marks.iterdir())


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[Planted]:
    p = Planted(tmp_path / "cwd", tmp_path / "pp", tmp_path / "marks")
    p.marks.mkdir()
    for where in (p.cwd, p.pythonpath):
        for rel in PLANTS:
            f = where / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            tag = f"{where.name}-{rel.replace('/', '.')}"
            f.write_text(
                "import os as _os\n"
                f"open({str(p.marks)!r} + '/{tag}-' + str(_os.getpid()), 'w').close()\n"
            )
    yield p


def gf(*args: str) -> list[str]:
    """gpufault itself, isolated (-I, this checkout by absolute path): only
    its children can import a plant. Spelled out, not paths.module_argv,
    so that the test runs unchanged against the code before the fix."""
    boot = (
        "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
        "runpy.run_module('pyctl', run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-I", "-c", boot, str(REPO), *args]


def test_the_plants_work(planted: Planted) -> None:
    """The fixture's own check: a plain interpreter in that directory with
    that PYTHONPATH imports the plants (so their absence below means
    something)."""
    subprocess.run(
        [sys.executable, "-c", "import ctypes, pyctl"],
        cwd=planted.cwd,
        env=planted.env(),
        check=True,
        timeout=30,
    )
    assert planted.imported() and all(m.startswith("cwd-") for m in planted.imported())
    for m in planted.marks.iterdir():
        m.unlink()
    subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            "import sys; sys.path[:0] = sys.argv[1:]; import ctypes",
            str(planted.pythonpath),
        ],
        cwd=REPO,
        check=True,
        timeout=30,
    )
    assert planted.imported()[0].startswith("pp-ctypes.py-"), planted.imported()


EXPERIMENT = """
name = "child-isolation"
version = 1
title = "a service target and one observe step, for the isolation test"
description = "Starts the reference service and arms one fault step on it."
slo_id = "completions-p99"

[target]
service = { device = "cpu", args = ["--batch-wait", "0"] }

[load]
rate = 10.0
prompt = "hello world"
max_tokens = 2
timeout = "2s"

[phases]
baseline = "2s"
method = "3s"

[steady_state]
error_rate = "<= 50%"
quorum = "50%"

[[method]]
name = "observe getpid"
fault = { lib = "libc", fn = "getpid", action = "observe" }
start = "0s"
duration = "2s"
"""


@pytest.mark.root
def test_experiment_run_service_and_step_children(planted: Planted, tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the service needs torch")
    exp = tmp_path / "iso.toml"
    exp.write_text(EXPERIMENT)
    db = tmp_path / "gf.db"
    r = subprocess.run(
        gf("experiment", "run", str(exp), "--db", str(db)),
        cwd=planted.cwd,
        env=planted.env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert planted.imported() == [], out
    # Both children ran: the service answered the load, the step armed.
    assert re.search(r"experiment \w+: .* against http://127\.0\.0\.1:\d+ \(pid \d+\)", out), out
    import sqlite3

    with sqlite3.connect(db) as c:
        steps = c.execute("SELECT count(*) FROM experiment_steps").fetchone()[0]
        runs = c.execute("SELECT count(*) FROM runs").fetchone()[0]
    assert steps == 1 and runs >= 1, out


@pytest.mark.root
def test_service_rank_1(planted: Planted) -> None:
    pytest.importorskip("torch", reason="the service needs torch")
    p = subprocess.Popen(
        gf("service", "--ranks", "2", "--port", "0"),
        cwd=planted.cwd,
        env=planted.env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    try:
        assert p.stderr is not None
        for ln in p.stderr:
            lines.append(ln)
            if "serving on" in ln:
                break
        ready = lines[-1] if lines else ""
        assert re.search(r"rank 1 pid \d+ tid \d+", ready), "".join(lines)
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    assert p.returncode == 0, "".join(lines)
    assert planted.imported() == [], "".join(lines)


def test_hooks_children(planted: Planted, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    r = subprocess.run(
        gf("hooks", "vram-pressure", "--allocator", "host-double", "--share", "0.01",
           "--duration", "1", "--db", str(db)),
        cwd=planted.cwd, env=planted.env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert planted.imported() == [], r.stderr
    assert r.returncode == 0 and '"holding"' in r.stdout.replace(" ", ""), (r.stdout, r.stderr)
    pytest.importorskip("torch", reason="tc-measure needs torch")
    r = subprocess.run(
        gf("hooks", "tc-measure", "--bits", "sign", "--rate", "1e-2", "--db", str(db)),
        cwd=planted.cwd, env=planted.env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert planted.imported() == [], r.stderr
    assert r.returncode == 0 and "bit-flip faults" in r.stderr, (r.stdout, r.stderr)


@pytest.mark.root
def test_a_served_controller_in_the_clients_directory(planted: Planted, tmp_path: Path) -> None:
    """`gpufault serve` started as `python -c` has '' on sys.path; its
    forked controller enters the client's directory (the plants) and
    imports modules late: none of them may come from there."""
    from procio import start_controller

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "GPUFAULT_NO_SERVER"}
    env["GPUFAULT_RUN_DIR"] = str(run_dir)
    code = "import sys; sys.argv = ['gpufault', 'serve']; from pyctl.entry import main; main()"
    srv, _ = start_controller(
        [sys.executable, "-c", code], marker="listening on", env=env, cwd=REPO
    )
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        r = subprocess.run(
            gf("trace", "--pid", str(sleeper.pid), "--lib", "libc", "--fn", "getpid",
               "--duration", "1s", "--db", str(tmp_path / "gf.db")),
            cwd=planted.cwd, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert srv.stderr is not None
        served = srv.stderr.readline()
    finally:
        sleeper.kill()
        sleeper.wait()
        srv.send_signal(signal.SIGTERM)
        srv.wait(timeout=30)
    assert "controller" in served and "gpufault trace" in served, (served, r.stderr)
    assert r.returncode == 0, r.stderr
    assert planted.imported() == [], r.stderr
    assert not (run_dir / wire.SOCKET_NAME).exists()
