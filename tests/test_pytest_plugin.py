"""The pytest plugin (pyctl/pytest_plugin.py), run the way users run it:
inner test files, in a pytest subprocess each (pytester), whose plugin is
loaded through the installed pytest11 entry point, arm faults into a real
build/targets/gf_target process.

What "nothing armed" means here: the target's calls return their normal
values, and the first bytes of gf_victim in its memory are the library
file's again (a uprobe is a breakpoint written into the process's copy of
the page; each inner run records them while armed too, so the check is
seen to tell the two apart). The inner target outlives the fixture's
teardown (a session-scoped fixture) and reports from there, before the
inner process ends: a probe the teardown left would still be in place
then (only the process's exit would have removed it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gftarget import LIB, TARGET

from pyctl import pytest_plugin

pytest_plugins = ["pytester"]

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="requires root (BPF, ptrace)")
BUILT = pytest.mark.skipif(not TARGET.exists(), reason="run `make build` (build/targets/gf_target)")
TESTS = Path(__file__).resolve().parent

# The inner runs' conftest: a gf_target for the whole inner session, and
# what it does after every test's teardown, written to GF_PLUGIN_REPORT.
CONFTEST = f"""
import json, os, sys
sys.path.insert(0, {str(TESTS)!r})
import pytest
from gftarget import LIB, Target
from pyctl.symbols import resolve

REPORT = os.environ["GF_PLUGIN_REPORT"]
NOTES = {{}}
FIXTURES = []


def note(key, value):
    NOTES[key] = value


def victim_code(pid):
    \"\"\"The first 8 bytes of gf_victim in the process, and in the file.\"\"\"
    sym = resolve.symbols(resolve.find_library(str(LIB), pid), "gf_victim")[0]
    for ln in open(f"/proc/{{pid}}/maps"):
        p = ln.split()
        if p[-1] == str(LIB) and "x" in p[1]:
            lo, off = int(p[0].split("-")[0], 16), int(p[2], 16)
            addr = lo + sym.offset - off
    with open(f"/proc/{{pid}}/mem", "rb") as f:
        f.seek(addr)
        mem = f.read(8)
    with open(LIB, "rb") as f:
        f.seek(sym.offset)
        disk = f.read(8)
    return mem.hex(), disk.hex()


@pytest.fixture(scope="session")
def target():
    t = Target()
    yield t
    # After every function-scoped fixture's teardown (the gpufault
    # fixture's disarm), also after a KeyboardInterrupt.
    mem, disk = victim_code(t.pid)
    sessions = [
        {{"run_id": s.run_id, "status": s.status, "active": s.active,
          "child_rc": getattr(s, "rc", None), "isolated": hasattr(s, "proc")}}
        for fx in FIXTURES for s in fx.sessions
    ]
    NOTES["end"] = {{"rets": [r[3] for r in t.victim(3)], "mem": mem, "disk": disk,
                    "sessions": sessions}}
    with open(REPORT, "w") as f:
        json.dump(NOTES, f)
    t.close()


@pytest.fixture
def gf(gpufault):
    FIXTURES.append(gpufault)
    return gpufault


def pytest_collection_modifyitems(items):
    # The same tests with the fixture's isolate default set by the marker.
    if os.environ.get("GF_INNER_ISOLATE"):
        for it in items:
            it.add_marker(pytest.mark.gpufault(isolate=True))
"""

# The inner tests: two pass (a fault fires; a signal's exit is linked),
# one fails while a fault is armed in every call (or is interrupted by a
# SIGINT, with GF_INNER_INTERRUPT), the next looks at the target right after.
INNER = """
import os, signal, time
import pytest
from conftest import LIB, Target, note, victim_code

pytestmark = pytest.mark.gpufault


def test_fault_fires(gf, target):
    h = gf.arm(gf.Fault.fail(str(LIB), "gf_victim", ret=-5, nth=2), target.pid)
    assert [r[3] for r in target.victim(3)] == [2, -5, 4]
    (f,) = gf.assert_fired(h, n=1, function="gf_victim", code=-5, timeout=5)
    assert f.call_seq == 2 and f.ret == -5
    note("fired", {"fault_id": f.fault_id, "db": str(gf.db), "show": f.show()})


def test_followed_by_exit(gf):
    t = Target()
    h = gf.arm(gf.Fault.signal(str(LIB), "gf_victim", signal="SIGUSR1", nth=2), t.pid)
    with pytest.raises(EOFError):
        t.victim(3)
    assert t.p.wait(10) == -signal.SIGUSR1
    (f,) = gf.assert_fired(h, n=1, action="signal", timeout=5)
    (link,) = gf.assert_followed(f, "exit", term_signal="SIGUSR1", timeout=10)
    note("followed", {"fault_id": f.fault_id, "db": str(gf.db), "link": link})


def test_fails_while_armed(gf, target):
    gf.arm(gf.Fault.fail(str(LIB), "gf_victim", ret=-7, every=1), target.pid)
    rets = [r[3] for r in target.victim(2)]
    note("armed", {"rets": rets, "mem": victim_code(target.pid)[0]})
    if os.environ.get("GF_INNER_INTERRUPT"):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C: a KeyboardInterrupt here
        time.sleep(60)
    assert rets == [], "fails on purpose, with the fault armed"


def test_after_the_failure(target):
    mem, disk = victim_code(target.pid)
    note("next", {"rets": [r[3] for r in target.victim(2)], "mem": mem, "disk": disk})
"""


def _run_inner(
    pytester: pytest.Pytester, tmp_path: Path, env: dict[str, str]
) -> tuple[pytest.RunResult, dict]:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=INNER)
    report = tmp_path / "report.json"
    for k, v in {"GF_PLUGIN_REPORT": str(report), **env}.items():
        pytester._monkeypatch.setenv(k, v)
    # --strict-markers: the plugin registers the marker (pytest_configure).
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers",
                                        timeout=240)  # fmt: skip
    assert report.exists(), res.stdout.str() + res.stderr.str()
    return res, json.loads(report.read_text())


def _unfaulted(after: dict) -> None:
    """gf_victim(i) returns i + 1 (the target counts from 1), and no probe is in it."""
    assert after["rets"] == list(range(2, 2 + len(after["rets"]))), after
    assert after["mem"] == after["disk"], f"a probe is still in gf_victim: {after}"


def _sessions_ended(rep: dict, n: int, isolate: bool) -> None:
    sessions = rep["end"]["sessions"]
    assert len(sessions) == n, rep
    for s in sessions:
        assert s["status"] == "done" and not s["active"] and s["isolated"] == isolate, s
        if isolate:
            # The child controller is gone. (-15: disarm's SIGTERM reached a
            # child that had ended its run by itself, the target's exit, and
            # was in the interpreter's finalization, handlers reset.)
            assert s["child_rc"] in (0, -15), s


@ROOT
@BUILT
@pytest.mark.root
@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
def test_fixture_fires_and_a_failing_test_leaves_nothing_armed(
    pytester: pytest.Pytester, tmp_path: Path, isolate: bool
) -> None:
    res, rep = _run_inner(pytester, tmp_path, {"GF_INNER_ISOLATE": "1"} if isolate else {})
    res.assert_outcomes(passed=3, failed=1)
    assert "fails on purpose, with the fault armed" in res.stdout.str()
    # The passing test's fault is in its database, and show reads it back.
    fired = rep["fired"]
    assert "gf_victim" in fired["show"] and fired["db"].endswith("gpufault.db")
    out = subprocess.run(
        [sys.executable, "-m", "pyctl", "show", fired["fault_id"], "--db", fired["db"]],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and "gf_victim" in out.stdout, out
    # While armed, the failing test's calls failed and the probe was in
    # place; right after its teardown, the next test's calls are normal.
    armed = rep["armed"]
    assert armed["rets"] == [-7, -7] and armed["mem"] != rep["next"]["disk"], rep
    _unfaulted(rep["next"])
    _unfaulted(rep["end"])
    _sessions_ended(rep, 3, isolate)


@ROOT
@BUILT
@pytest.mark.root
def test_ctrl_c_in_a_test_still_disarms(pytester: pytest.Pytester, tmp_path: Path) -> None:
    res, rep = _run_inner(pytester, tmp_path, {"GF_INNER_INTERRUPT": "1"})
    assert res.ret == pytest.ExitCode.INTERRUPTED, res.stdout.str()
    assert "KeyboardInterrupt" in res.stdout.str()
    assert rep["armed"]["rets"] == [-7, -7] and "next" not in rep, rep
    # pytest tore the fixtures down at the session's end: the fault is gone
    # while the inner process still ran.
    assert rep["armed"]["mem"] != rep["end"]["disk"], rep
    _unfaulted(rep["end"])
    _sessions_ended(rep, 3, False)


@ROOT
@BUILT
@pytest.mark.root
def test_assertion_messages_say_what_was_found(pytester: pytest.Pytester, tmp_path: Path) -> None:
    import gpufault

    _res, rep = _run_inner(pytester, tmp_path, {})
    fol = rep["followed"]
    assert fol["link"]["detail"]["term_signal"] == 10, fol
    with gpufault.Evidence(fol["db"]) as ev:
        f = ev.fault(fol["fault_id"])
        records = ev.faults()
    with pytest.raises(AssertionError) as e:
        gpufault.assert_followed(f, "error-return")
    text = str(e.value)
    assert text.startswith(f"gpufault: fault {f.fault_id} (gf_victim signal, pid {f.pid} ")
    assert "was not followed by error-return\n  what followed:\n" in text
    assert "killed by SIGUSR1 (10)" in text and "[rule: exit-of-faulted-process]" in text
    with pytest.raises(AssertionError, match="not followed by exit with exit_status=3"):
        gpufault.assert_followed(f.fault_id, "exit", db=fol["db"], exit_status=3)
    with pytest.raises(AssertionError) as e:
        gpufault.assert_fired(records, n=2, action="signal")
    text = str(e.value)
    assert text.startswith("gpufault: expected 2 faults (signal), found 1\n  matching:\n")
    assert f"    {f.fault_id}: gf_victim signal via" in text, text
    with pytest.raises(AssertionError) as e:
        gpufault.assert_fired(records, function="gf_victim", code=-5)
    text = str(e.value)
    assert text.startswith("gpufault: expected at least 1 fault of gf_victim with code -5, found 0")
    assert f"  fired, not matching:\n    {f.fault_id}: gf_victim signal via" in text, text
    assert gpufault.assert_fired(records, action="signal") == [f]
    with pytest.raises(ValueError, match="kind 'exited'"):
        gpufault.assert_followed(f, "exited")


NOT_ROOT_INNER = f"""
import os
import pytest

LIB = {str(LIB)!r}


@pytest.mark.gpufault
def test_marked(gpufault):
    raise AssertionError("ran without root")


def test_unmarked_gets_the_error(gpufault):
    with pytest.raises(gpufault.MissingPrerequisite, match="run as root"):
        gpufault.arm(gpufault.Fault.fail(LIB, "gf_victim", ret=-5), os.getpid())
    assert gpufault.sessions == []
"""


def _as_nobody(pytester: pytest.Pytester, base: Path, *args: str) -> pytest.RunResult:
    """The inner pytest as uid/gid 65534 (nobody), holding nothing but
    CAP_DAC_READ_SEARCH: the interpreter lives under root's 0700 home."""
    base.mkdir()
    os.chown(base, 65534, 65534)  # made here: the inner run makes its basetemp in it
    return pytester.run(
        "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
        "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "--strict-markers",
        f"--basetemp={base / 'tmp'}", *args, timeout=120,
    )  # fmt: skip


@ROOT  # to become another user
@pytest.mark.root
def test_marker_skips_a_non_root_user_with_the_reason(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    p = pytester.makepyfile(test_nobody=NOT_ROOT_INNER)
    res = _as_nobody(pytester, tmp_path / "base1", str(p))
    res.assert_outcomes(passed=1, skipped=1)
    res.stdout.fnmatch_lines(["*SKIPPED*test_nobody.py*requires root (BPF, ptrace): "
                              "running as uid 65534*"])  # fmt: skip
    # A CI host that must run them: the same reason, as a failure.
    res = _as_nobody(pytester, tmp_path / "base2", "--gpufault-no-skip", str(p))
    res.assert_outcomes(passed=1, errors=1)  # failed in its setup
    res.stdout.fnmatch_lines(["*gpufault: requires root (BPF, ptrace): running as uid 65534 "
                              "(--gpufault-no-skip)*"])  # fmt: skip
    assert "ran without root" not in res.stdout.str()


def test_skip_reasons() -> None:
    assert pytest_plugin.reason(1000, None) == "requires root (BPF, ptrace): running as uid 1000"
    # Without root the kernel cannot be probed: root is the reason given.
    assert pytest_plugin.reason(1000, "anything").startswith("requires root")
    assert pytest_plugin.reason(0, "no uprobe PMU in /sys/bus/event_source/devices") == (
        "kernel lacks uprobes/BPF: no uprobe PMU in /sys/bus/event_source/devices"
    )
    assert pytest_plugin.reason(0, None, "make build").startswith(
        "gpufault's BPF objects are not built"
    )
    assert pytest_plugin.reason(0, None, None) is None


@ROOT
@BUILT
@pytest.mark.root
def test_this_host_arms_faults() -> None:
    """The real probe (root, BTF, the uprobe PMU, a load of the engine's
    programs) finds nothing missing here: a wrong path or a broken load
    would skip every marked test on a host that can run them."""
    code = "from pyctl import pytest_plugin as p; print(repr(p.skip_reason()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "None", out
