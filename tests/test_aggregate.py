"""In-kernel summaries (bpf/aggregate.bpf.c, pyctl/calls/aggregate.py) on real
processes: exact counts, plausible latency buckets, the per-thread split,
error codes named from the catalog, and nothing left attached afterwards
(after an error, a bad input or Ctrl-C). The struct mirrors:
tests/test_aggregate_abi.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import our_bpf_progs, requires_root
from gftarget import LIB, Target
from procio import finish

from pyctl import paths

REPO = Path(__file__).resolve().parent.parent
OBJ = paths.bpf_object("aggregate")
needs_obj = pytest.mark.skipif(not OBJ.exists(), reason=f"{OBJ} missing: run make build")
pytestmark = [pytest.mark.root, requires_root, needs_obj]


# ---- helpers ----------------------------------------------------------------
def agg_progs(unheld: bool = True) -> int:
    """Our aggregation programs loaded in the kernel now (this session's:
    another one's beside it are not counted; unheld: conftest.our_bpf_progs)."""
    return len(our_bpf_progs(lambda n: n.startswith("agg_"), unheld))


def settles_at(before: int, timeout: float = 10.0) -> bool:
    """Programs go after an RCU grace period: await the count."""
    deadline = time.monotonic() + timeout
    while agg_progs() > before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # a kernel count, no event to wait on
    return True


@pytest.fixture
def baseline():
    n = agg_progs()
    yield n
    assert settles_at(n), "aggregation programs left loaded"


# ---- counts, latency, threads -------------------------------------------------
@pytest.mark.parametrize("mode", ["session", "pair", "count"])
def test_counts_exact(target: Target, baseline: int, mode: str, monkeypatch) -> None:
    from pyctl.calls.aggregate import MODE_PROGS, Aggregator

    latency = mode != "count"
    if mode == "pair":  # the older kernels' way, forced
        monkeypatch.setenv("GPUFAULT_NO_UPROBE_SESSION", "1")
    with Aggregator(target.pid, str(LIB), ["gf_victim", "gf_alloc"], latency=latency) as agg:
        if mode == "session" and agg.mode != "session":
            pytest.skip("this kernel has no uprobe sessions (6.12+)")
        assert agg.mode == mode
        assert agg_progs(unheld=False) == len(MODE_PROGS[mode])  # what agg holds
        target.cmd("quiet 1000 1")
        assert len(target.alloc(7)) == 7
        s = agg.read()
    by = {f.function: f for f in s.functions}
    assert by["gf_victim"].calls == 1000 and by["gf_alloc"].calls == 7
    assert s.source == "kernel" and not s.notes
    if not latency:
        assert all(f.latency is None and f.returns == 0 for f in s.functions)
        return
    v = by["gf_victim"]
    assert v.returns == 1000 and sum(v.hist) == 1000
    assert v.latency is not None and not v.latency.exact
    # Plausible: a few hundred ns to microseconds here (the uretprobe's own
    # trampoline is inside the window); nothing under 64 ns or above 0.1 s.
    used = [i for i, c in enumerate(v.hist) if c]
    assert used[0] >= 6 and used[-1] <= 27, used
    assert v.latency.p50 <= v.latency.p99 and v.latency.p99 <= max(v.latency.max, 1) * 2
    assert v.latency.max < 100_000_000
    assert v.to_json()["errors"] is None  # gf_victim is not in the catalog


def test_per_thread_split_exact(target: Target, baseline: int) -> None:
    from pyctl.calls.aggregate import Aggregator

    with Aggregator(target.pid, str(LIB), ["gf_victim"], per_thread=True) as agg:
        rows = target.victim(300, threads=2)
        s = agg.read()
    tids = {r[1] for r in rows}
    assert len(tids) == 2
    got = {f.tid: (f.calls, f.returns) for f in s.functions}
    assert got == {tid: (300, 300) for tid in tids}


def test_no_private_stack(baseline: int) -> None:
    """Each program's stack stays under 64 bytes (no per-CPU private stack,
    which preempting threads would share: see tests/test_bpf_stack.py)."""
    from test_bpf_stack import PRIVATE_STACK_PROLOGUE, jit_image

    from pyctl.bpf.libbpf import BPF_TRACE_UPROBE_SESSION, BpfError, Object, lib
    from pyctl.calls.aggregate import PROGS

    for prog in PROGS:
        obj = Object(OBJ)
        try:
            for p in PROGS:
                obj.set_autoload(p, p == prog)
            if prog == "agg_session":
                obj.set_expected_attach_type(prog, BPF_TRACE_UPROBE_SESSION)
            try:
                obj.load()
            except BpfError:
                if prog == "agg_session":
                    continue  # no sessions on this kernel (6.12+)
                raise
            head = jit_image(lib().bpf_program__fd(obj.program(prog)))[:64]
            assert PRIVATE_STACK_PROLOGUE not in head, f"{prog} uses a per-CPU private stack"
        finally:
            obj.close()


# ---- errors named from the catalog ------------------------------------------------
CUDA_CHILD = textwrap.dedent("""
    import ctypes, sys
    cu = ctypes.CDLL(sys.argv[1])
    p = ctypes.c_uint64()
    print("ready", flush=True)
    for line in sys.stdin:
        what, n = line.split()
        for _ in range(int(n)):
            if what == "alloc":
                cu.cuMemAlloc_v2(ctypes.byref(p), 16)
            else:
                cu.cuInit(0)
        print("done", flush=True)
""")


def test_error_codes_named(baseline: int) -> None:
    from pyctl.calls.aggregate import Aggregator

    lib = str(paths.DOUBLE_LIBCUDA)
    p = subprocess.Popen(
        [sys.executable, "-c", CUDA_CHILD, lib],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdin and p.stdout
    try:
        assert p.stdout.readline().strip() == "ready"

        def do(cmd: str) -> None:
            p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
            assert p.stdout.readline().strip() == "done"  # type: ignore[union-attr]

        # By its alias: the summary still names the site cuMemAlloc_v2, as
        # faults, show and metrics do (pyctl/symbols/names.py).
        with Aggregator(p.pid, lib, ["cuMemAlloc", "cuInit"]) as agg:
            do("alloc 5")  # before cuInit: CUDA_ERROR_NOT_INITIALIZED
            do("init 1")
            do("alloc 3")  # no context: CUDA_ERROR_INVALID_CONTEXT
            s = agg.read()
    finally:
        p.stdin.close()
        p.wait(timeout=10)
    by = {f.function: f for f in s.functions}
    a = by["cuMemAlloc_v2"]
    assert a.aliases == ["cuMemAlloc"] and "cuMemAlloc" not in by
    assert "cuMemAlloc_v2 (alias cuMemAlloc)  (libcuda.so.1)" in s.render().splitlines()
    assert (a.calls, a.errors) == (8, 8)
    assert a.errors_by_code == {"CUDA_ERROR_NOT_INITIALIZED": 5, "CUDA_ERROR_INVALID_CONTEXT": 3}
    assert (by["cuInit"].calls, by["cuInit"].errors) == (1, 0)
    assert "CUDA_ERROR_NOT_INITIALIZED 5, CUDA_ERROR_INVALID_CONTEXT 3" in s.render()


# ---- refusals and clean-up ----------------------------------------------------------
def test_bad_pid_and_unknown_function_one_line(target: Target, baseline: int) -> None:
    from pyctl.cli.calls import calls

    r = CliRunner()
    res = r.invoke(calls, ["live", "--pid", "999999999", "--lib", str(LIB), "--fn", "gf_victim"])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (
        "gpufault: no process 999999999: check the pid (is it still running?)"
    )
    res = r.invoke(
        calls, ["live", "--pid", str(target.pid), "--lib", str(LIB), "--fn", "no_such_fn"]
    )
    assert res.exit_code == 2, res.output
    assert res.output.startswith("gpufault: symbol 'no_such_fn' not found")
    assert res.output.strip().count("\n") == 0
    res = r.invoke(calls, ["live", "--pid", str(target.pid), "--lib", "libnosuch", "--fn", "x"])
    assert res.exit_code == 2 and res.output.count("\n") == 1
    res = r.invoke(
        calls,
        ["live", "--pid", str(target.pid), "--lib", str(LIB), "--fn", "x", "--duration", "0"],
    )
    # A bad value is click's usage error (main() makes it one line).
    assert res.exit_code == 2 and "--duration" in res.output
    assert settles_at(baseline)


def test_attach_failure_leaves_nothing(target: Target, baseline: int, monkeypatch) -> None:
    """An error half-way through attaching (the entry program after the
    return one, every way tried) detaches what was attached and closes."""
    from pyctl.bpf.libbpf import BpfError, Object
    from pyctl.calls import aggregate

    real = Object.attach_uprobe_multi
    calls = {"n": 0}

    def fail_second(self, *a, **kw):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] >= 2:
            raise BpfError(22, "cannot attach uprobe: Invalid argument")
        return real(self, *a, **kw)

    monkeypatch.setattr(Object, "attach_uprobe_multi", fail_second)
    monkeypatch.setattr(Object, "attach_uprobe", fail_second)
    monkeypatch.setenv("GPUFAULT_NO_UPROBE_SESSION", "1")
    agg = aggregate.Aggregator(target.pid, str(LIB), ["gf_victim"])
    with pytest.raises(aggregate.AggregateError, match="cannot attach"):
        agg.start()
    assert agg.obj is None


def test_duration_and_target_exit(target: Target, baseline: int) -> None:
    from pyctl.calls import aggregate

    agg = aggregate.Aggregator(target.pid, str(LIB), ["gf_victim"], latency=False)
    t0 = time.monotonic()
    s = aggregate.run(agg, 0.5, on_start=lambda a: target.cmd("quiet 200 1"))
    assert 0.4 < time.monotonic() - t0 < 5
    assert s.functions[0].calls == 200 and agg.obj is None
    # The target exits while counting: the run ends by itself.
    agg = aggregate.Aggregator(target.pid, str(LIB), ["gf_victim"], latency=False)
    notes: list[str] = []
    s = aggregate.run(agg, 30, on_start=lambda a: target.close(), on_notice=notes.append)
    assert notes == [f"pid {target.pid} exited"] and agg.obj is None


LIVE = "from pyctl.cli.calls import calls; calls(sys.argv[1:], prog_name='gpufault calls')"


def test_ctrl_c_prints_the_summary_and_detaches(target: Target, baseline: int) -> None:
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; " + LIVE,
            "live",
            "--pid",
            str(target.pid),
            "--lib",
            str(LIB),
            "--fn",
            "gf_victim",
            "--count-only",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert p.stderr is not None
    try:
        line = p.stderr.readline()
        assert line.startswith("Counting 1 function of "), line
        target.cmd("quiet 2000 1")
        p.send_signal(signal.SIGINT)
        out, err = finish(p, 20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    doc = json.loads(out)
    assert doc["functions"][0]["calls"] == 2000 and doc["source"] == "kernel"
