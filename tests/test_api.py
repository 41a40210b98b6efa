"""The library API (pyctl.api, `import gpufault`): specs, sessions in this
process and in a child, evidence objects, the error hierarchy. Real BPF
on real gf_target processes where a session is armed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import requires_root
from gftarget import LIB, Target

import gpufault
from gpufault import BadInput, Fault, FaultSpec, GpufaultError, TargetGone
from pyctl.api.faults import spec_from_json

REPO = Path(__file__).resolve().parent.parent
VICTIM = (str(LIB), "gf_victim")


def _handlers() -> dict[int, object]:
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}


# ---- specs, without root -----------------------------------------------------


def test_constructors_are_the_one_spec_builder() -> None:
    assert Fault.fail("libcuda", "cuMemAlloc_v2", ret="CUDA_ERROR_OUT_OF_MEMORY", nth=3) == (
        FaultSpec.from_fields({"lib": "libcuda", "fn": "cuMemAlloc_v2", "action": "fail",
                               "ret": "CUDA_ERROR_OUT_OF_MEMORY", "nth": 3})
    )  # fmt: skip
    s = Fault.stall("libnccl", "ncclAllReduce", stall=0.005, prob="5%", max_fires=2)
    assert (s.action, s.stall_ms, s.prob_ppm, s.max_fires) == ("stall", 5.0, 50_000, 2)
    assert Fault.signal("libc", ["read", "write"], signal="SIGSEGV").signo == signal.SIGSEGV
    assert not Fault.observe("libc", "read", stack=False).capture_stack
    t = Fault.trace("libc", "read", entry_only=True)
    assert (t.trace, t.entry_only, t.action) == (True, True, "observe")
    for s in (Fault.fail("libcuda", "cuMemAlloc_v2", ret=2, sticky=True, when="arg2>=1M"),
              Fault.corrupt("libc", "read", corrupt="arg2:zero", every=7)):  # fmt: skip
        assert spec_from_json(s.to_json()) == s


def test_bad_input_is_one_line_and_a_gpufault_error() -> None:
    with pytest.raises(BadInput, match=r"--ret: .*NO_SUCH_CODE") as e:
        Fault.fail("libcuda", "cuMemAlloc_v2", ret="CUDA_ERROR_NO_SUCH_CODE")
    assert isinstance(e.value, GpufaultError) and "\n" not in str(e.value)
    with pytest.raises(BadInput, match="give the command as a list"):
        gpufault.Target.run("./app ARG")
    with pytest.raises(BadInput, match="at least one fault"):
        gpufault.arm([], 1234, db="x.db")
    with pytest.raises(BadInput, match="no knob"):
        Fault.from_template("cuda-oom-sticky", nosuchknob=1)


# ---- sessions ------------------------------------------------------------------


@requires_root
def test_arm_inside_an_event_loop_off_the_main_thread(target: Target, tmp_path: Path) -> None:
    """asyncio.to_thread: no main thread, no signal handler installed or
    changed; exactly the 3rd call fails; the evidence is readable at once."""

    async def scenario() -> tuple[list, object, object]:
        before = _handlers()  # asyncio.run's own SIGINT handler included
        spec = Fault.fail(*VICTIM, ret=-5, nth=3)
        h = await asyncio.to_thread(gpufault.arm, spec, target.pid, db=tmp_path / "gf.db",
                                    duration=30)  # fmt: skip
        with h:
            assert threading.current_thread() is threading.main_thread()
            assert _handlers() == before
            rows = await asyncio.to_thread(target.victim, 5)
            assert await asyncio.to_thread(h.wait_fires, 1, 10)
            faults = h.faults()
        return rows, faults, h

    rows, faults, h = asyncio.run(scenario())
    assert [r[3] for r in rows] == [2, 3, -5, 5, 6]
    assert len(faults) == 1 and faults[0].call_seq == 3 and faults[0].retval == -5
    text = faults[0].show()
    assert faults[0].fault_id in text and "gf_victim" in text
    assert h.status == "done" and h.counters.fires == 1 and h.counters.calls == 5
    assert h.run_row()["status"] == "done"


@requires_root
def test_leaving_the_block_by_an_exception_disarms(target: Target, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="the harness's own"):
        with gpufault.arm(Fault.fail(*VICTIM, ret=-7, sticky=True), target.pid,
                          db=tmp_path / "gf.db") as h:  # fmt: skip
            assert [r[3] for r in target.victim(2)] == [-7, -7]
            raise RuntimeError("the harness's own failure")
    assert not h.active and h.status == "done"
    # Nothing is left armed: the same calls return their own values.
    assert [r[3] for r in target.victim(3)] == [2, 3, 4]


@requires_root
def test_wait_fires_is_false_when_the_session_ends_first(target: Target, tmp_path: Path) -> None:
    h = gpufault.arm(Fault.fail(*VICTIM, ret=-1, nth=100), target.pid, db=tmp_path / "gf.db",
                     duration=1.0)  # fmt: skip
    try:
        assert h.wait_fires(1, timeout=30) is False  # ends at its 1 s deadline, long before 30
        assert h.wait(5) and h.fires == 0
    finally:
        h.disarm()


@requires_root
def test_a_target_that_is_gone_is_target_gone(tmp_path: Path) -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    with pytest.raises(TargetGone, match=f"no process {p.pid}"):
        gpufault.arm(Fault.observe(*VICTIM), p.pid, db=tmp_path / "gf.db")
    assert not (tmp_path / "gf.db").exists() or True  # a refused target writes no run


@requires_root
def test_isolated_session_imports_nothing_from_cwd_or_pythonpath(
    target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child controller runs `python -I` with this package by absolute
    path: a planted pyctl/ (and ctypes.py) in the cwd and on PYTHONPATH
    never runs, though the child runs as root."""
    marker = tmp_path / "planted-ran"
    for d in (tmp_path / "cwd", tmp_path / "pp"):
        (d / "pyctl").mkdir(parents=True)
        code = f"open({str(marker)!r}, 'a').write({str(d)!r} + '\\n')\n"
        (d / "pyctl" / "__init__.py").write_text(code)
        (d / "ctypes.py").write_text(code)
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pp"))
    spec = Fault.fail(*VICTIM, ret=-9, nth=1)
    with gpufault.arm(spec, target.pid, db=tmp_path / "gf.db", duration=30, isolate=True) as h:
        assert isinstance(h, gpufault.IsolatedSession)
        assert [r[3] for r in target.victim(2)] == [-9, 3]
        assert h.wait_fires(1, timeout=10)
        assert [f.fault_id for f in h.faults()] == [f.fault_id for f in h.fired()]
    assert h.status == "done" and h.proc is not None and h.proc.returncode == 0
    assert not marker.exists(), marker.read_text()


@requires_root
def test_an_isolated_session_takes_a_relative_db_from_the_callers_directory(
    target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child controller runs in /: a relative db is the caller's,
    from its own directory (make demo-experiment's build/... was refused
    as "/build: no such directory")."""
    (tmp_path / "build").mkdir()
    monkeypatch.chdir(tmp_path)
    spec = Fault.fail(*VICTIM, ret=-9, nth=1)
    with gpufault.arm(spec, target.pid, db="build/rel.db", duration=30, isolate=True) as h:
        assert [r[3] for r in target.victim(2)] == [-9, 3]
        assert h.wait_fires(1, timeout=10)
        assert len(h.faults()) == 1
    assert h.status == "done" and (tmp_path / "build" / "rel.db").is_file()


@requires_root
def test_isolated_session_disarms_when_its_parent_is_killed(target: Target, tmp_path: Path) -> None:
    """SIGKILL of the process that armed it: the child sees its request
    pipe close (and PR_SET_PDEATHSIG), disarms and closes its run row."""
    db = tmp_path / "gf.db"
    code = (
        "import sys, gpufault\n"
        f"h = gpufault.arm(gpufault.Fault.fail({VICTIM[0]!r}, 'gf_victim', ret=-3, sticky=True),"
        f" {target.pid}, db={str(db)!r}, isolate=True)\n"
        "print(h.run_id, h.proc.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    assert p.stdout is not None
    run_id, child = p.stdout.readline().split()
    assert [r[3] for r in target.victim(1)] == [-3]
    p.kill()
    p.wait()
    # The child is not ours to wait for: its pidfd says when it is gone.
    fd = os.pidfd_open(int(child))
    try:
        import select

        assert select.select([fd], [], [], 20)[0], "child controller still running 20 s later"
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)
    assert [r[3] for r in target.victim(2)] == [2, 3]  # disarmed: its own values again
    with gpufault.open_evidence(db) as ev:
        assert ev.run(run_id)["status"] == "done"
        assert len(ev.faults(run_id)) == 1


@requires_root
def test_trace_and_a_sessions_summary_as_data(target: Target, tmp_path: Path) -> None:
    """A trace session's summary counts exactly the calls made while it
    was armed; trace() returns the same Summary type for a timed run."""
    with gpufault.arm(Fault.trace(*VICTIM), target.pid, db=tmp_path / "gf.db") as h:
        target.victim(5)
        target.victim(2, threads=2)
    (f,) = h.summary().functions
    assert f.calls == 9 and f.function == "gf_victim"
    assert h.summary().to_json()["calls"] == 9 and "gf_victim" in h.summary().render()
    s = gpufault.trace(target.pid, *VICTIM, db=tmp_path / "gf.db", duration=0.5)
    assert [g.calls for g in s.functions] == [0] and s.run_id != h.run_id
    with pytest.raises(BadInput, match="give duration="):
        gpufault.trace(target.pid, *VICTIM, db=tmp_path / "gf.db")


@requires_root
def test_an_isolated_session_outlives_the_thread_that_armed_it(
    target: Target, tmp_path: Path
) -> None:
    """PR_SET_PDEATHSIG follows the forking thread: the child is forked by
    the library's own long-lived launcher, so a session armed from a
    short-lived thread keeps firing after that thread is gone."""
    box: list[object] = []
    th = threading.Thread(
        target=lambda: box.append(
            gpufault.arm(
                Fault.fail(*VICTIM, ret=-4, sticky=True),
                target.pid,
                db=tmp_path / "gf.db",
                duration=60,
                isolate=True,
            )  # fmt: skip
        )
    )
    th.start()
    th.join()
    (h,) = box
    assert isinstance(h, gpufault.IsolatedSession)
    try:
        assert [r[3] for r in target.victim(2)] == [-4, -4]
        assert h.active and h.proc is not None and h.proc.poll() is None
    finally:
        h.disarm()
    assert h.proc.returncode == 0 and h.status == "done"


def test_every_user_facing_error_is_in_the_one_hierarchy() -> None:
    """The classes the CLI prints as one line (pyctl/errors.py) are all
    GpufaultErrors, so `except gpufault.GpufaultError` catches what the
    command line would have printed, whichever module raised it."""
    from pyctl import errors

    types = [t for t in errors.user_error_types() if t is not PermissionError]
    assert len(types) >= 20
    assert [t.__name__ for t in types if not issubclass(t, GpufaultError)] == []
    from pyctl.engine import StoreWriteError
    from pyctl.spec import SpecError

    assert issubclass(SpecError, BadInput) and issubclass(SpecError, ValueError)
    assert issubclass(StoreWriteError, gpufault.EvidenceWriteError)
