"""The fault engine against real processes with real BPF on this kernel.

Targets: build/targets/gf_target and its library (known bodies), driven
through stdin so every probe is attached before the calls start.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from gftarget import LIB, TARGET, Target

from pyctl.bpf import abi
from pyctl.engine import Engine, EngineError
from pyctl.spec import FaultSpec

pytestmark = [pytest.mark.root]

if not TARGET.exists():  # pragma: no cover - the Makefile builds it first
    pytest.skip("build/targets/gf_target missing: run make build", allow_module_level=True)


@contextmanager
def armed(db: Path, pid: int, *specs: FaultSpec, **kw) -> Iterator[Engine]:
    for s in specs:
        s.tgid = pid
    eng = Engine(list(specs), db_path=db, pid=pid, argv=["test"], **kw)
    eng.start()
    try:
        yield eng
    finally:
        eng.close()


def spec(fn: str = "gf_victim", **kw) -> FaultSpec:
    return FaultSpec(lib=str(LIB), fn=fn, **kw)


def q(db: Path, sql: str, *args) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def test_trace_records_every_call_with_args_and_returns(target: Target, tmp_db: Path) -> None:
    with armed(tmp_db, target.pid, spec(trace=True)) as eng:
        rows = target.victim(200, threads=8)
        eng.drain()
        assert eng.lost()["events_lost"] == 0
    assert len(rows) == 1600 and all(r[3] == r[2] + 1 for r in rows)
    calls = q(tmp_db, "SELECT arg1, ret, tid, latency_ns, call_seq FROM calls")
    assert len(calls) == 1600
    assert all(ret == a + 1 for a, ret, *_ in calls)
    assert {c[2] for c in calls} == {r[1] for r in rows}
    assert all(c[3] > 0 for c in calls)
    # call_seq is exact under concurrency: 1..1600, each once.
    assert sorted(c[4] for c in calls) == list(range(1, 1601))


def test_a_trace_sets_up_no_stack_copy_and_a_fault_does(target: Target, tmp_db: Path) -> None:
    """observe never fires, so a trace watches no mappings and its ustacks
    ring is one page (bpf/main_object.py); a fault that keeps its stack
    gets both, and --no-stack neither."""
    from pyctl.bpf.main_object import USTACKS_RING_BYTES, USTACKS_RING_UNUSED

    with armed(tmp_db, target.pid, spec(trace=True)) as eng:
        assert eng.evidence.mapwatch == {} and eng.ustacks.size == USTACKS_RING_UNUSED
    with armed(tmp_db, target.pid, spec(action="fail", ret=1, nth=10**9)) as eng:
        assert list(eng.evidence.mapwatch) == [target.pid]
        assert eng.ustacks.size == USTACKS_RING_BYTES
    with armed(tmp_db, target.pid, spec(action="signal", signo=10, nth=10**9,
                                        capture_stack=False)) as eng:  # fmt: skip
        assert eng.evidence.mapwatch == {} and eng.ustacks.size == USTACKS_RING_UNUSED


def fired_calls(db: Path) -> list[int]:
    return sorted(r[0] for r in q(db, "SELECT call_seq FROM faults"))


@pytest.mark.parametrize(
    "kw, expect",
    [
        ({"nth": 7}, [7]),
        ({"every": 50}, list(range(50, 401, 50))),
        ({"after": 395}, [396, 397, 398, 399, 400]),
        ({"every": 7, "max_fires": 3}, None),  # 3 fires, whichever calls
    ],
    ids=["nth", "every", "after", "max"],
)
def test_triggers_exact_with_8_threads(target: Target, tmp_db: Path, kw, expect) -> None:
    # signal 0 would be a no-op; use `fail` via the engine's mechanism? no:
    # observe never fires, so use corrupt of an unused pointer-free target:
    # a SIGNAL action with a harmless ignored signal (SIGWINCH) counts fires.
    s = spec(action="signal", signo=28, capture_stack=False, **kw)
    with armed(tmp_db, target.pid, s) as eng:
        target.victim(50, threads=8)
        eng.drain()
        c = eng.counters()[0]
    assert c.calls == 400
    got = fired_calls(tmp_db)
    if expect is None:
        assert len(got) == 3 and c.fires == 3
    else:
        assert got == expect and c.fires == len(expect)


def test_predicate_counts_only_matching_calls(target: Target, tmp_db: Path) -> None:
    # arg1 >= 30: calls i = 30..40 match; the 2nd matching call is i=31.
    s = spec(action="signal", signo=28, pred=(1, abi.PRED_OPS[">="], 30), nth=2)
    with armed(tmp_db, target.pid, s) as eng:
        target.victim(40)
        eng.drain()
        assert eng.counters()[0].calls == 11
    assert q(tmp_db, "SELECT raw FROM args WHERE idx=1") == [(31,)]


def test_probability_within_binomial_bound(target: Target, tmp_db: Path) -> None:
    n, p = 20000, 0.1
    s = spec(action="signal", signo=28, prob_ppm=int(p * 1e6), capture_stack=False)
    with armed(tmp_db, target.pid, s) as eng:
        target.cmd(f"quiet {n // 4} 4")
        eng.drain()
        c = eng.counters()[0]
    assert c.calls == n
    sd = math.sqrt(n * p * (1 - p))
    assert abs(c.fires - n * p) < 5 * sd, (c.fires, n * p, sd)


def test_nothing_fires_after_the_deadline(target: Target, tmp_db: Path) -> None:
    s = spec(action="signal", signo=28, duration_s=0.05)
    with armed(tmp_db, target.pid, s) as eng:
        deadline = time.monotonic() + 0.06
        while time.monotonic() < deadline:  # wait on the clock itself
            pass
        target.victim(20)
        eng.drain()
        c = eng.counters()[0]
    assert c.fires == 0 and c.expired == 20
    assert q(tmp_db, "SELECT count(*) FROM faults") == [(0,)]


def test_signal_kills_target_and_is_linked(target: Target, tmp_db: Path) -> None:
    s = spec("gf_alloc", action="signal", signo=11, nth=2)
    with armed(tmp_db, target.pid, s) as eng:
        with pytest.raises(EOFError):
            target.alloc(3)
        assert target.p.wait(timeout=10) == -11
        # The exit record may trail the fire: poll until both links are in.
        for _ in range(100):
            eng.poll(0.05)
            if eng.stats.links >= 2:
                break
    links = q(tmp_db, "SELECT kind, rule, detail FROM links ORDER BY ts_ns")
    assert [k for k, *_ in links] == ["signal", "exit"]
    assert all(
        r == "signal-in-faulted-process" or r == "exit-of-faulted-process" for _, r, _ in links
    )
    fault = q(tmp_db, "SELECT function, call_seq, action, comm FROM faults")
    assert fault == [("gf_alloc", 2, "signal", "gf_target")]
    regs = dict(q(tmp_db, "SELECT reg, value FROM registers"))
    assert len(regs) == abi.NREGS and regs["si"] == 2 * 4096
    frames = q(tmp_db, "SELECT symbol FROM stacks ORDER BY depth")
    assert frames and frames[0][0].startswith("libgftarget.so!gf_alloc")


def test_corrupt_zeroes_the_output_pointer(target: Target, tmp_db: Path) -> None:
    s = spec("gf_alloc", action="corrupt", corrupt=(1, 0, abi.CORRUPT_OPS["zero"], 0, 8), nth=2)
    with armed(tmp_db, target.pid, s) as eng:
        got = target.alloc(3)
        eng.drain()
    assert got == [(1, 0, 0x101000), (2, 0, 0), (3, 0, 0x103000)]
    ((outcome,),) = q(tmp_db, "SELECT outcome FROM faults")
    assert outcome and "corrupt_addr" in outcome or eng.wu


def test_corrupt_xor_flips_bits(target: Target, tmp_db: Path) -> None:
    s = spec("gf_alloc", action="corrupt", corrupt=(1, 0, abi.CORRUPT_OPS["xor"], 0xFF, 1), nth=1)
    with armed(tmp_db, target.pid, s):
        got = target.alloc(1)
    assert got == [(1, 0, 0x101000 ^ 0xFF)]


@pytest.mark.parametrize("mode", ["skip", "after"])
def test_fail_returns_injected_value(target: Target, tmp_db: Path, mode: str) -> None:
    s = spec(action="fail", ret=-5, mode=mode, nth=2)
    with armed(tmp_db, target.pid, s) as eng:
        rows = target.victim(4)
        eng.drain()
        mech = eng.mechanism
    rets = [r[3] for r in rows]
    outs = [r[4] for r in rows]
    assert rets == [2, -5, 4, 5]
    # skip: the body never ran (out untouched); after: it ran, ret replaced.
    assert outs == ([2, -1, 6, 8] if mode == "skip" else [2, 4, 6, 8])
    ((m, ret),) = q(tmp_db, "SELECT mechanism, ret FROM faults")
    assert m == mech and ret == -5


def test_sticky_fails_every_later_call(target: Target, tmp_db: Path) -> None:
    s = spec(action="fail", ret=-9, nth=3, sticky=True)
    with armed(tmp_db, target.pid, s):
        rows = target.victim(6)
    assert [r[3] for r in rows] == [2, 3, -9, -9, -9, -9]


def test_same_thread_next_error_is_linked(target: Target, tmp_db: Path) -> None:
    # gf_alloc #1 fails; the same thread's next non-zero return (gf_victim
    # returns i + 1) is linked to that fault, once; other threads are not.
    a = spec("gf_alloc", action="fail", ret=-9, nth=1)
    o = spec(action="observe", trace=True)
    with armed(tmp_db, target.pid, a, o) as eng:
        target.victim(2, threads=2)  # other threads: nothing to link yet
        out = target.cmd("both 2")
        eng.drain()
    assert out[0] == "both i=1 alloc=-9 victim=2"
    ((fid,),) = q(tmp_db, "SELECT fault_id FROM faults")
    links = q(tmp_db, "SELECT fault_id, rule, tid FROM links WHERE kind='error-return'")
    assert links == [(fid, "same-thread-next-error", target.pid)]


def test_stall_holds_only_the_calling_thread(target: Target, tmp_db: Path) -> None:
    s = spec(action="stall", stall_ms=30, nth=1)
    with armed(tmp_db, target.pid, s):
        t0 = time.monotonic()
        rows = target.victim(3)
        took = time.monotonic() - t0
    assert [r[3] for r in rows] == [2, 3, 4]
    assert took >= 0.03


def test_unknown_symbol_leaves_nothing(target: Target, tmp_db: Path) -> None:
    with pytest.raises(EngineError, match="not found"):
        Engine([spec(fn="no_such_fn")], db_path=tmp_db, pid=target.pid).start()
    assert not tmp_db.exists()


def test_dead_pid_refused(tmp_db: Path) -> None:
    with pytest.raises(EngineError, match="no process"):
        Engine([spec()], db_path=tmp_db, pid=2**22 + 7).start()
    assert not tmp_db.exists()


def test_database_is_root_only(target: Target, tmp_db: Path) -> None:
    with armed(tmp_db, target.pid, spec(trace=True)) as eng:
        target.victim(3)
        eng.drain()
    assert tmp_db.stat().st_mode & 0o777 == 0o600


def test_stall_20ms_median_from_inside_the_target(target: Target, tmp_db: Path) -> None:
    s = spec(action="stall", stall_ms=20, every=1, capture_stack=False)
    with armed(tmp_db, target.pid, s):
        (line,) = target.cmd("timed 25")
    p50 = int(line.split("p50=")[1].split()[0])
    assert 18e6 <= p50 <= 22e6, line  # 20 ms +- 2 ms at the median (a spec, not a bench)


def test_already_traced_target_is_refused_before_attach(target: Target, tmp_db: Path) -> None:
    import shutil
    import subprocess

    if shutil.which("strace") is None:
        pytest.skip("needs strace as the other tracer")
    st = subprocess.Popen(
        ["strace", "-f", "-o", "/dev/null", "-p", str(target.pid)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert st.stderr is not None
        while "attached" not in st.stderr.readline():  # strace says when it holds it
            pass
        with pytest.raises(EngineError, match="already traced"):
            Engine(
                [spec(action="fail", ret=1, tgid=target.pid)], db_path=tmp_db, pid=target.pid
            ).start()
        assert not tmp_db.exists()
    finally:
        st.terminate()
        st.wait()
    assert [r[3] for r in target.victim(2)] == [2, 3]


def test_target_killed_mid_stall(target: Target, tmp_db: Path) -> None:
    import os
    import signal
    import threading

    s = spec(action="stall", nth=1, capture_stack=False)  # a hang
    with armed(tmp_db, target.pid, s) as eng:
        th = threading.Thread(target=lambda: pytest.raises(EOFError, target.victim, 1))
        th.start()
        assert eng.copilot.wait_stalled(1, timeout=20)
        os.kill(target.pid, signal.SIGKILL)
        th.join(timeout=20)
        # The copilot (our own thread) reaps our child: ask it, not Popen.
        target.p.wait(timeout=20)
        # The engine keeps running and records how the process ended.
        for _ in range(100):
            eng.poll(0.05)
            if eng.stats.links:
                break
    import json

    links = sqlite3.connect(tmp_db).execute("SELECT kind, detail FROM links").fetchall()
    exits = [json.loads(d) for k, d in links if k == "exit"]
    assert exits and exits[0]["term_signal"] == signal.SIGKILL


def test_uprobe_multi_one_link_per_file_and_per_site_fallback(
    target: Target, tmp_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel has uprobe_multi (6.6+, as here) the engine puts every
    site of a file in one link (per entry/return); a site probed by two specs
    goes into a second link. Without it (older kernels, forced here) each
    site has its own link. Both must count every call exactly."""
    from pyctl import capabilities, engine

    if not capabilities.uprobe_multi():
        pytest.skip("this kernel has no uprobe_multi links")
    for multi in (True, False):
        monkeypatch.setattr(engine, "uprobe_multi", lambda m=multi: m)
        trace = spec(trace=True)
        fault = spec(action="fail", ret=-5, nth=2)  # same site as the trace
        with armed(tmp_db, target.pid, trace, fault) as eng:
            n_sites = len(eng.atts)
            fds, links = len(eng.obj.link_fds), len(eng.obj.links)  # type: ignore[union-attr]
            rows = target.victim(4)
            eng.drain()
            assert eng.multi is multi
        assert [r[3] for r in rows] == [2, -5, 4, 5]
        if multi:
            # entry + return of the trace, entry (+ return) of the fault at
            # the same offset -> rank-2 links: never one link per site.
            assert 2 <= fds < n_sites * 2 and links == 2  # + the two tracepoints
        else:
            assert fds == 0 and links >= n_sites + 2
    n = q(tmp_db, "SELECT count(*) FROM calls WHERE kind = 1")[0][0]
    assert n >= 8  # 4 traced calls in each of the two runs


def test_a_stall_stores_the_held_time_show_prints(target: Target, tmp_db: Path) -> None:
    import json

    s = spec(action="stall", stall_ms=20, nth=1, capture_stack=False)
    # The copilot's held time (its stop and resume): the signal path, the
    # default for a timed stall, has no stop to time (tests/test_fastpath.py).
    with armed(tmp_db, target.pid, s, mechanism="copilot") as eng:
        target.victim(2)
        eng.drain()
    ((ret, lat, outcome),) = q(tmp_db, "SELECT ret, latency_ns, outcome FROM faults")
    cop = json.loads(outcome)["copilot"]
    # Not the entry record's 0: how long the copilot held the thread.
    assert ret is None and lat == cop["resume_ns"] - cop["stop_ns"] and lat >= 20e6


def test_a_signal_that_kills_stores_that_the_call_did_not_return(
    target: Target, tmp_db: Path
) -> None:
    import json

    s = spec("gf_alloc", action="signal", signo=6, nth=1, capture_stack=False)
    with armed(tmp_db, target.pid, s) as eng:
        with pytest.raises(EOFError):
            target.alloc(2)
        assert target.p.wait(timeout=10) == -6
        for _ in range(100):
            eng.poll(0.05)
            if eng.stats.links >= 2:
                break
    ((ret, outcome),) = q(tmp_db, "SELECT ret, outcome FROM faults")
    o = json.loads(outcome)
    assert ret is None and o["returned"] is False and "SIGABRT" in o["no_return"]


def test_a_hang_stores_its_held_time_where_it_ends(target: Target, tmp_db: Path) -> None:
    import json
    import threading

    s = spec(action="stall", nth=1, capture_stack=False)  # a hang: until released
    with armed(tmp_db, target.pid, s) as eng:
        th = threading.Thread(target=target.victim, args=(1,))
        th.start()
        assert eng.copilot.wait_stalled(1, timeout=20)
        eng.drain()
        # Held now: no end yet, so no latency (never the entry record's 0).
        assert q(tmp_db, "SELECT latency_ns FROM faults") == [(None,)]
        assert eng.copilot.release() == 1
        th.join(timeout=20)
        eng.drain()
    ((lat, outcome),) = q(tmp_db, "SELECT latency_ns, outcome FROM faults")
    cop = json.loads(outcome)["copilot"]
    assert lat == cop["resume_ns"] - cop["stop_ns"] > 0
