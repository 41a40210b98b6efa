"""The signal fast path (issue 26, pyctl/fastpath, docs/copilot.md "The
signal fast path"): fail-skips carried out by gfsig.so inside the target,
reached by bpf_send_signal_thread from the entry uprobe.

Unit: the first-instruction decoder. Root: the mechanism chosen and its
fallback with the reason; the failures the target saw equal the recorded
fires and the helper's own count (engine at 1/8/64 threads, and the real
controller loop through the CLI); detach leaves the target's SigCgt and
maps as before and no tracer; a SIGKILLed controller leaves a target whose
calls run normally; a helper file that is not root's is refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from gftarget import LIB, TARGET, Target, on_victim
from procio import finish, start_controller

from pyctl.fastpath.sites import SiteError, decode

REPO = Path(__file__).resolve().parent.parent


# ---- unit: which first instructions the handler can step back over ----------
@pytest.mark.parametrize(
    "code,want",
    [
        (b"\x55\x48\x89\xe5", (1, 8)),  # push %rbp
        (b"\x41\x57", (2, 8)),  # push %r15
        (b"\xf3\x0f\x1e\xfa", (4, 0)),  # endbr64
        (b"\x48\x83\xec\x28", (4, 0x28)),  # sub $0x28,%rsp
        (b"\x48\x81\xec\x00\x01\x00\x00", (7, 0x100)),  # sub $0x100,%rsp
        (b"\x48\x89\xf8", (3, 0)),  # mov %rdi,%rax
        (b"\x90", (1, 0)),
        (b"\xb8\x15\x00\x00\x00", (5, 0)),  # mov $0x15,%eax (glibc's access)
        (b"\x80\x3d\x31\x33\x0e\x00\x00", (7, 0)),  # cmpb $0,0xe3331(%rip) (read)
        (b"\x8b\x47\x10", (3, 0)),  # mov 0x10(%rdi),%eax (pthread_mutex_lock)
        (b"\x48\x85\xff", (3, 0)),  # test %rdi,%rdi (free)
        (b"\x48\x8b\x44\x24\x08", (5, 0)),  # mov 0x8(%rsp),%rax: SIB + disp8
        (b"\x31\xc0", (2, 0)),  # xor %eax,%eax
    ],
)
def test_decode_known_first_instructions(code: bytes, want: tuple[int, int]) -> None:
    assert decode(code + b"\0" * 8) == want


@pytest.mark.parametrize(
    "code",
    [
        b"\x48\x89\xfb",  # mov %rdi,%rbx: writes a callee-saved register
        b"\x48\x89\xe5",  # mov %rsp,%rbp
        b"\x48\xc7\x07\x00\x10\x00\x00",  # movq $0x1000,(%rdi): a memory write
        b"\xe9\x00\x00\x00\x00",  # jmp
        b"\xbb\x01\x00\x00\x00",  # mov $1,%ebx
        b"\x48\x8b\x1f",  # mov (%rdi),%rbx
        b"\x48\x89\x07",  # mov %rax,(%rdi): a store
    ],
)
def test_decode_refuses_the_rest(code: bytes) -> None:
    with pytest.raises(SiteError, match="not one the signal path knows"):
        decode(code + b"\0" * 8)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_state_mirror_matches_the_header(tmp_path: Path) -> None:
    """inject.py's offsets and formats of struct gfsig_state/gfsig_site are
    the C layout (compiled against pyctl/fastpath/gfsig.h)."""
    from pyctl.fastpath import inject

    src = tmp_path / "layout.c"
    src.write_text(
        '#include <stdio.h>\n#include <stddef.h>\n#include "gfsig.h"\n'
        'int main(void){printf("%zu %zu %zu %zu %zu %zu %llu %d\\n",'
        "offsetof(struct gfsig_state, armed), offsetof(struct gfsig_state, deadline_ns),"
        "offsetof(struct gfsig_state, nsites), offsetof(struct gfsig_state, handled),"
        "offsetof(struct gfsig_state, sites), sizeof(struct gfsig_site),"
        "GFSIG_MAGIC, GFSIG_MAX_SITES);return 0;}\n"
    )
    exe = tmp_path / "layout"
    hdr = REPO / "pyctl" / "fastpath"
    subprocess.run(["cc", f"-I{hdr}", "-o", str(exe), str(src)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True,
                                          check=True).stdout.split()]  # fmt: skip
    assert got == [
        inject.OFF_ARMED, inject.OFF_DEADLINE, inject.OFF_NSITES, inject.OFF_HANDLED,
        inject.OFF_SITES, inject.SITE_FMT.size, inject.STATE_MAGIC, inject.MAX_SITES,
    ]  # fmt: skip


# ---- root: real BPF, real processes ----------------------------------------
root = pytest.mark.root
needs_target = pytest.mark.skipif(not TARGET.exists(), reason="run make build")


def _sig_masks(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("SigCgt", "SigIgn", "TracerPid"):
                out[k] = v.strip()
    return out


def _helper_mapped(pid: int) -> bool:
    return _helper_inodes(pid) > 0


def _helper_inodes(pid: int) -> int:
    """How many distinct gfsig objects pid maps."""
    with open(f"/proc/{pid}/maps") as f:
        return len({line.split()[4] for line in f if "gfsig" in line})


def _engine(t: Target, db: Path, **kw: object) -> object:
    from pyctl.engine import Engine
    from pyctl.spec import FaultSpec

    spec = FaultSpec(
        lib=str(LIB), fn="gf_victim", action="fail", capture_stack=False, tgid=t.pid, **kw
    )
    eng = Engine([spec], db_path=db, pid=t.pid, argv=["fastpath"], use_signal=True)
    eng.start()
    return eng


@root
@needs_target
def test_skip_values_and_clean_detach(tmp_path: Path) -> None:
    t = Target()
    try:
        t.victim(1, threads=2)  # glibc's thread handlers in place before the baseline
        before = _sig_masks(t.pid)
        eng = _engine(t, tmp_path / "gf.db", ret=-5, nth=2)
        try:
            assert eng.mechanism == "signal", eng.signal_refusal
            assert int(_sig_masks(t.pid)["SigCgt"], 16) & (1 << (signal.SIGURG - 1))
            assert _sig_masks(t.pid)["TracerPid"] == "0"  # nothing holds the target
            rows = t.victim(4)
            eng.drain()
        finally:
            eng.close()
        assert [r[3] for r in rows] == [2, -5, 4, 5]
        assert [r[4] for r in rows] == [2, -1, 6, 8]  # the body did not run
        assert eng.signal_counters == {"handled": 1, "inert": 0, "foreign": 0, "stray": 0}
        assert eng.end_error is None
        assert _sig_masks(t.pid) == before  # no handler left
        assert _helper_mapped(t.pid)  # inert: a late handler run must find its code
        assert [r[3] for r in t.victim(3)] == [2, 3, 4]  # later calls normal
        # The next run re-arms the same copy: one helper in the target.
        eng = _engine(t, tmp_path / "gf2.db", ret=-6, nth=1)
        try:
            assert eng.mechanism == "signal" and eng.helper.reused, eng.signal_refusal
            assert [r[3] for r in t.victim(2)] == [-6, 3]
        finally:
            eng.close()
        assert eng.signal_counters["handled"] == 1  # this run's, not the first's
        assert _sig_masks(t.pid) == before
        assert _helper_inodes(t.pid) == 1
        con = sqlite3.connect(tmp_path / "gf.db")
        assert {m for (m,) in con.execute("SELECT mechanism FROM faults")} == {"signal"}
        (caps,) = con.execute("SELECT capabilities FROM runs").fetchone()
        assert json.loads(caps)["signal"] is True
    finally:
        t.close()


@root
@needs_target
@pytest.mark.parametrize("threads", [1, 8, 64])
def test_recorded_fires_equal_what_the_target_saw(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """test_fail_matrix's exactness check on the signal path: a 16 KiB fires
    ring that fills, so some fires are skipped; the failures the target saw
    equal the recorded fires, BPF's fire count and the helper's."""
    from test_fail_matrix import _injected

    from pyctl import engine as engine_mod

    monkeypatch.setattr(engine_mod, "FIRES_RING_BYTES", 16384)
    calls = 4096
    t = Target()
    try:
        eng = _engine(t, tmp_path / "gf.db", ret=-7, every=2)
        try:
            assert eng.mechanism == "signal", eng.signal_refusal
            rows = t.victim(calls // threads, threads=threads)
            eng.drain()
            c = eng.counters()[0]
            lost = eng.lost()
        finally:
            eng.close()
    finally:
        t.close()
    failed = sum(1 for r in rows if r[3] == -7)
    ok = sum(1 for r in rows if r[3] == r[2] + 1)
    print(f"\n{threads} threads: {failed} failed, {c.fires} fires, {eng.signal_counters}")
    assert failed + ok == calls == c.calls
    assert failed == _injected(tmp_path / "gf.db") == c.fires == eng.signal_counters["handled"]
    assert c.fires + lost["fires_skipped"] == calls // 2


def _cli(pid: int, db: Path, *extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, GPUFAULT_SIGNAL="1")
    argv = [sys.executable, "-m", "pyctl", *on_victim("inject", pid), "--action", "fail"]
    argv += ["--ret", "-7", "--no-stack", "--db", str(db), *extra]
    ctl, _ = start_controller(argv, env=env, cwd=REPO)
    return ctl


@root
@needs_target
def test_cli_records_exactly_the_failures_the_target_saw(tmp_path: Path) -> None:
    """The real controller loop (`gpufault inject`, GPUFAULT_SIGNAL=1)."""
    t = Target()
    db = tmp_path / "gf.db"
    try:
        ctl = _cli(t.pid, db, "--every", "2")
        rows = t.victim(1024, threads=8)
        ctl.send_signal(signal.SIGINT)
        _, err = finish(ctl, 60)
        after = _sig_masks(t.pid)
        mapped = _helper_mapped(t.pid)
    finally:
        t.close()
    assert ctl.returncode == 0, err
    failed = sum(1 for r in rows if r[3] == -7)
    con = sqlite3.connect(db)
    mechs = {m for (m,) in con.execute("SELECT mechanism FROM faults")}
    (n,) = con.execute("SELECT count(*) FROM faults").fetchone()
    (stats,) = con.execute("SELECT stats FROM runs").fetchone()
    assert mechs == {"signal"}
    assert failed == n == json.loads(stats)["signal"]["handled"] == 8 * 1024 // 2
    assert not int(after["SigCgt"], 16) & (1 << (signal.SIGURG - 1))
    assert mapped  # inert, for the next run


@root
@needs_target
def test_controller_sigkilled_leaves_a_target_that_runs_normally(tmp_path: Path) -> None:
    """SIGKILL the controller while every call fails: its BPF links go with
    it, so no call fails after that; the helper stays mapped with its handler
    (nothing can run in the target to remove it), and that handler passes a
    real SIGURG on to the default action (ignore): the target lives on."""
    t = Target()
    try:
        ctl = _cli(t.pid, tmp_path / "gf.db", "--every", "1")
        assert all(r[3] == -7 for r in t.victim(20))
        ctl.kill()
        ctl.wait(10)
        # A SIGKILLed controller cannot remove its control socket: ours to do.
        for sock in Path("/run/gpufault").glob(f"{ctl.pid}-*.sock"):
            sock.unlink()
        rows = t.victim(50, threads=4)
        os.kill(t.pid, signal.SIGURG)
        os.kill(t.pid, signal.SIGURG)
        assert [r[3] for r in t.victim(3)] == [2, 3, 4]
        st = _sig_masks(t.pid)
        # The next run takes the dead run's copy back, disarms it, re-arms.
        eng = _engine(t, tmp_path / "gf2.db", ret=-6, every=1)
        try:
            assert eng.mechanism == "signal" and eng.helper.reused, eng.signal_refusal
            assert [r[3] for r in t.victim(2)] == [-6, -6]
        finally:
            eng.close()
        after = _sig_masks(t.pid)
    finally:
        t.close()
    assert all(r[3] == r[2] + 1 for r in rows)
    assert st["TracerPid"] == "0"
    assert not int(after["SigCgt"], 16) & (1 << (signal.SIGURG - 1))
    assert t.p.returncode == 0


def _handler_so(tmp_path: Path, *sigs: str) -> Path:
    """A preload whose constructor installs handlers for sigs."""
    src = tmp_path / "own.c"
    calls = "".join(f"signal({s}, h);" for s in sigs)
    src.write_text(
        "#include <signal.h>\nstatic void h(int s){(void)s;}\n"
        f"__attribute__((constructor)) static void init(void){{{calls}}}\n"
    )
    so = tmp_path / "own.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    return so


@root
@needs_target
def test_target_that_owns_sigurg_gets_sigwinch(tmp_path: Path) -> None:
    """The target's own SIGURG handler is left alone: the helper takes
    SIGWINCH, BPF sends it, and detach puts SigCgt back as it was."""
    t = Target(env=dict(os.environ, LD_PRELOAD=str(_handler_so(tmp_path, "SIGURG"))))
    try:
        t.victim(1, threads=2)
        before = _sig_masks(t.pid)
        eng = _engine(t, tmp_path / "gf.db", ret=-5, every=1)
        try:
            assert eng.mechanism == "signal", eng.signal_refusal
            assert eng.copilot_signal == signal.SIGWINCH
            rows = t.victim(3)
            eng.drain()
        finally:
            eng.close()
        assert _sig_masks(t.pid) == before
    finally:
        t.close()
    assert [r[3] for r in rows] == [-5, -5, -5]
    assert eng.signal_counters["handled"] == 3


@root
@needs_target
def test_target_with_its_own_handlers_gets_the_copilot(tmp_path: Path) -> None:
    """A target that handles SIGURG and SIGWINCH keeps both: the run goes
    through the copilot, and the run row and the warnings say why."""
    so = _handler_so(tmp_path, "SIGURG", "SIGWINCH")
    t = Target(env=dict(os.environ, LD_PRELOAD=str(so)))
    try:
        eng = _engine(t, tmp_path / "gf.db", ret=-5, every=1)
        try:
            assert eng.mechanism == "copilot"
            why = eng.signal_refusal or ""
            assert "own SIGURG handler" in why and "own SIGWINCH handler" in why, why
            assert any("signal fast path not used" in w for w in eng.start_warnings)
            rows = t.victim(3)
            eng.drain()
        finally:
            eng.close()
        assert not _helper_mapped(t.pid)
    finally:
        t.close()
    assert [r[3] for r in rows] == [-5, -5, -5]
    con = sqlite3.connect(tmp_path / "gf.db")
    (caps,) = con.execute("SELECT capabilities FROM runs").fetchone()
    assert "SIGURG handler" in json.loads(caps)["signal_refusal"]


@root
def test_helper_not_owned_by_root_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyctl.fastpath import FastpathError, inject

    bad = tmp_path / "gfsig.so"
    shutil.copy(inject.GFSIG, bad)
    os.chown(bad, 65534, 65534)
    monkeypatch.setattr(inject, "GFSIG", bad)
    with pytest.raises(FastpathError, match="not a root-owned file"):
        inject.read_helper()
    link = tmp_path / "link.so"
    monkeypatch.undo()
    link.symlink_to(inject.GFSIG)  # the real, root-owned helper
    monkeypatch.setattr(inject, "GFSIG", link)
    with pytest.raises(FastpathError):
        inject.read_helper()  # a symlink is not followed


@root
def test_refusals_leave_nothing_behind() -> None:
    """A target that only computes (no thread in a blocking call) and one
    whose thread blocks SIGURG: one-line refusals, the target not traced,
    no helper mapped, its signal state as before."""
    from pyctl.fastpath import FastpathError, load

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    blocked = subprocess.Popen(
        [sys.executable, "-c",
         "import signal, sys, time\n"
         "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGURG])\n"
         "print('ready', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert blocked.stdout is not None and blocked.stdout.readline() == "ready\n"
        before = _sig_masks(busy.pid)
        with pytest.raises(FastpathError, match="waiting in a blocking system call") as e:
            load(busy.pid, signal.SIGURG, [])
        assert "\n" not in str(e.value)
        assert _sig_masks(busy.pid) == before and not _helper_mapped(busy.pid)
        with pytest.raises(FastpathError, match=f"thread {blocked.pid} .* blocks SIGURG"):
            load(blocked.pid, signal.SIGURG, [])
        assert _sig_masks(blocked.pid)["TracerPid"] == "0"
        assert not _helper_mapped(blocked.pid)
        with pytest.raises(FastpathError, match="no such process"):
            load(2**22 + 7, signal.SIGURG, [])
    finally:
        for p in (busy, blocked):
            p.kill()
            p.wait()


@root
@needs_target
def test_helper_is_inert_past_its_deadline(tmp_path: Path) -> None:
    """The helper's own deadline (CLOCK_MONOTONIC, checked in the handler)
    holds whatever BPF does: with it moved into the past while BPF still
    fires, the calls run normally and the helper counts them inert."""
    import struct

    from pyctl.fastpath import inject

    t = Target()
    try:
        eng = _engine(t, tmp_path / "gf.db", ret=-5, every=1)
        try:
            assert eng.mechanism == "signal", eng.signal_refusal
            assert [r[3] for r in t.victim(2)] == [-5, -5]
            fd = os.open(f"/proc/{t.pid}/mem", os.O_RDWR)
            try:
                os.pwrite(fd, struct.pack("<Q", 1), eng.helper.state + inject.OFF_DEADLINE)
            finally:
                os.close(fd)
            rows = t.victim(3)
            eng.drain()
        finally:
            eng.close()
    finally:
        t.close()
    assert [r[3] for r in rows] == [2, 3, 4]
    assert eng.signal_counters == {"handled": 2, "inert": 3, "foreign": 0, "stray": 0}


@root
@needs_target
@pytest.mark.parametrize("threads", [1, 8, 64])
@pytest.mark.parametrize("ring", [None, 16384], ids=["default-ring", "16KiB-ring"])
def test_fires_exact_through_the_cli_on_the_signal_path(
    tmp_path: Path, threads: int, ring: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/test_fires_exact.py's check itself, with GPUFAULT_SIGNAL=1 in
    the controller's environment; then every fault row says 'signal'."""
    import test_fires_exact

    monkeypatch.setenv("GPUFAULT_SIGNAL", "1")
    test_fires_exact.test_cli_records_exactly_the_failures_the_target_saw(tmp_path, threads, ring)
    con = sqlite3.connect(tmp_path / "gf.db")
    assert {m for (m,) in con.execute("SELECT mechanism FROM faults")} == {"signal"}


@root
def test_errno_set_by_the_handler(tmp_path: Path) -> None:
    """--errno on the signal path: the handler runs in the faulted thread and
    sets its errno; glibc's access() starts with `mov $0x15,%eax`."""
    from test_errno import TARGET as ERRNO_TARGET
    from test_errno import ErrnoTarget

    from pyctl.engine import Engine
    from pyctl.spec import FaultSpec

    if not ERRNO_TARGET.exists():
        pytest.skip("build/targets/gf_errno missing: run make build")
    t = ErrnoTarget()
    try:
        s = FaultSpec(lib="libc", fn="access", action="fail", ret=-1, errno=5, nth=2, tgid=t.pid)
        eng = Engine([s], db_path=tmp_path / "gf.db", pid=t.pid, argv=["t"], use_signal=True)
        eng.start()
        try:
            assert eng.mechanism == "signal", eng.signal_refusal
            rows = t.access(3)
            eng.drain()
        finally:
            eng.close()
    finally:
        t.close()
    assert rows == [
        (0, 1, 0, 0, "Success"),
        (0, 2, -1, 5, "Input/output error"),
        (0, 3, 0, 0, "Success"),
    ]
    assert eng.signal_counters["handled"] == 1


# ---- stalls on the signal path: the helper waits on its own clock -----------
def _stall_engine(t: Target, db: Path, stall_ms: float, **kw: object) -> object:
    from pyctl.engine import Engine
    from pyctl.spec import FaultSpec

    s = FaultSpec(lib=str(LIB), fn="gf_victim", action="stall", stall_ms=stall_ms,
                  capture_stack=False, tgid=t.pid, **kw)  # fmt: skip
    eng = Engine([s], db_path=db, pid=t.pid, argv=["fastpath"], use_signal=True)
    eng.start()
    return eng


def _timed(t: Target, n: int) -> int:
    (line,) = [x for x in t.cmd(f"timed {n}") if x.startswith("timed")]
    return int(line.split("p50=")[1].split()[0])


@root
@needs_target
def test_stall_20ms_median_from_inside_the_target(tmp_path: Path) -> None:
    t = Target()
    try:
        eng = _stall_engine(t, tmp_path / "gf.db", 20, every=1)
        try:
            assert eng.mechanism == "signal", eng.signal_refusal
            p50 = _timed(t, 25)
            eng.drain()
        finally:
            eng.close()
        con = sqlite3.connect(tmp_path / "gf.db")
        assert {m for (m,) in con.execute("SELECT mechanism FROM faults")} == {"signal"}
        assert con.execute("SELECT count(*) FROM faults").fetchone()[0] == 25
    finally:
        t.close()
    print(f"\nsignal-path stall of 20 ms: p50 {p50 / 1e6:.2f} ms inside the target")
    assert 18e6 <= p50 <= 22e6
    assert eng.signal_counters["handled"] == 25


def _wait_handled(h: object, n: int, timeout: float = 10.0) -> None:
    """Until the helper counted n injections (its stall is under way): the
    helper's own counter, read on each wake of the controller's event wait."""
    import time

    end = time.monotonic() + timeout
    while h.raw_counters()["handled"] - h.base.get("handled", 0) < n:  # type: ignore[attr-defined]
        assert time.monotonic() < end, "no stall began"
        time.sleep(0.005)


@root
@needs_target
def test_detach_ends_a_stall_in_progress(tmp_path: Path) -> None:
    """A 30 s stall ends when the run is closed (gfsig_disarm wakes it):
    the call returns normally, and the target's signal state is as before."""
    import threading
    import time

    t = Target()
    try:
        before = _sig_masks(t.pid)
        eng = _stall_engine(t, tmp_path / "gf.db", 30_000, nth=1)
        out: list[int] = []
        th = threading.Thread(target=lambda: out.append(_timed(t, 1)))
        try:
            assert eng.mechanism == "signal", eng.signal_refusal
            th.start()
            _wait_handled(eng.helper, 1)
            t0 = time.monotonic()
        finally:
            eng.close()
        th.join(10)
        took = time.monotonic() - t0
        assert not th.is_alive() and out
        assert _sig_masks(t.pid) == before
        assert [r[3] for r in t.victim(2)] == [2, 3]
    finally:
        t.close()
    print(f"\nstall ended {took * 1e3:.1f} ms after close() began (call {out[0] / 1e6:.0f} ms)")
    assert took < 5 and out[0] < 10e9


@root
@needs_target
def test_controller_sigkilled_mid_stall_the_stall_ends_on_time(tmp_path: Path) -> None:
    """The stall's end is the helper's own clock: the controller SIGKILLed
    100 ms into a 600 ms stall, the call still returns at ~600 ms, neither
    earlier nor stuck, and the target runs on."""
    import threading
    import time

    from pyctl.fastpath import inject

    t = Target()
    try:
        env = dict(os.environ, GPUFAULT_SIGNAL="1")
        argv = [sys.executable, "-m", "pyctl", *on_victim("inject", t.pid), "--action", "stall"]
        argv += ["--stall", "600ms", "--nth", "1", "--no-stack", "--db", str(tmp_path / "g.db")]
        ctl, _ = start_controller(argv, env=env, cwd=REPO)
        out: list[int] = []
        th = threading.Thread(target=lambda: out.append(_timed(t, 1)))
        th.start()
        blob = inject.read_helper()
        base = inject._loaded_copy(t.pid, blob)
        assert base is not None
        h = inject.Helper(t.pid, signal.SIGURG, base + inject._dynsyms(blob)["gfsig_state"], 0, 0)
        _wait_handled(h, 1)
        time.sleep(0.1)  # the point under test: a kill mid-stall, 100 ms in
        ctl.kill()
        ctl.wait(10)
        for sock in Path("/run/gpufault").glob(f"{ctl.pid}-*.sock"):
            sock.unlink()
        th.join(10)
        assert not th.is_alive() and out
        assert [r[3] for r in t.victim(2)] == [2, 3]
    finally:
        t.close()
    print(f"\ncontroller killed mid-stall: the 600 ms stall took {out[0] / 1e6:.1f} ms")
    assert 590e6 <= out[0] <= 1000e6


@root
@needs_target
def test_stalls_from_8_threads_are_exact(tmp_path: Path) -> None:
    """Every call of 8 threads stalls 1 ms: BPF's fires = the helper's
    handled = the fault rows, and every call then ran its body."""
    t = Target()
    try:
        eng = _stall_engine(t, tmp_path / "gf.db", 1, every=1)
        try:
            assert eng.mechanism == "signal", eng.signal_refusal
            rows = t.victim(25, threads=8)
            eng.drain()
            c = eng.counters()[0]
        finally:
            eng.close()
    finally:
        t.close()
    assert all(r[3] == r[2] + 1 for r in rows) and len(rows) == 200
    con = sqlite3.connect(tmp_path / "gf.db")
    (n,) = con.execute("SELECT count(*) FROM faults").fetchone()
    assert c.fires == n == eng.signal_counters["handled"] == 200


@root
def test_the_loader_writes_only_a_new_sealable_memfd(tmp_path: Path) -> None:
    """The fd the target's memfd_create returned is checked before root
    writes it: a file the target may only read, a device, or a memfd that
    is not new and sealable is refused (the target's other threads could
    have put one at that number)."""
    from pyctl.fastpath import FastpathError
    from pyctl.fastpath.inject import _open_memfd

    ro = tmp_path / "readonly"
    ro.write_text("keep")
    ok = os.memfd_create("gfsig", os.MFD_ALLOW_SEALING)
    bad = [
        os.open(ro, os.O_RDONLY),
        os.open("/dev/null", os.O_RDONLY),
        os.memfd_create("gfsig"),  # not sealable
    ]
    try:
        os.close(_open_memfd(os.getpid(), ok))
        for fd in bad:
            with pytest.raises(FastpathError, match="not writing"):
                _open_memfd(os.getpid(), fd)
    finally:
        for fd in [ok, *bad]:
            os.close(fd)
    assert ro.read_text() == "keep"


# ---- the default: the signal path by trial, the copilot as fallback --------
def _seccomp_so(tmp_path: Path) -> Path:
    """A preload whose constructor installs an allow-everything seccomp
    filter (the target then shows Seccomp: 2, as under a container runtime)."""
    src = tmp_path / "seccomp.c"
    src.write_text(
        "#include <linux/filter.h>\n#include <linux/seccomp.h>\n#include <sys/prctl.h>\n"
        "__attribute__((constructor)) static void init(void){\n"
        "  struct sock_filter f[] = {BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)};\n"
        "  struct sock_fprog p = {1, f};\n"
        "  prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);\n"
        "  prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &p);\n}\n"
    )
    so = tmp_path / "seccomp.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    return so


def _seccomp_target(tmp_path: Path) -> Target:
    t = Target(env=dict(os.environ, LD_PRELOAD=str(_seccomp_so(tmp_path))))
    with open(f"/proc/{t.pid}/status") as f:
        assert "Seccomp:\t2" in f.read()
    return t


def _caps(db: Path) -> dict:
    con = sqlite3.connect(db)
    try:
        (caps,) = con.execute("SELECT capabilities FROM runs").fetchone()
        return json.loads(caps)
    finally:
        con.close()


def _default_engine(t: Target, db: Path, *specs: object, **kw: object) -> object:
    """An engine as a plain run gets it: no mechanism asked for."""
    from pyctl.engine import Engine

    eng = Engine(list(specs), db_path=db, pid=t.pid, argv=["default"], **kw)  # type: ignore[arg-type]
    eng.start()
    return eng


def _victim_spec(t: Target, **kw: object) -> object:
    from pyctl.spec import FaultSpec

    return FaultSpec(lib=str(LIB), fn="gf_victim", capture_stack=False, tgid=t.pid, **kw)


@root
@needs_target
def test_default_picks_the_signal_path_on_a_plain_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No mechanism asked for (and no GPUFAULT_SIGNAL): a fail-skip on a
    running plain target is the helper's; the run row says so, each fault row
    says 'signal' with the helper's counts in its outcome."""
    monkeypatch.delenv("GPUFAULT_SIGNAL", raising=False)
    t = Target()
    db = tmp_path / "gf.db"
    try:
        eng = _default_engine(t, db, _victim_spec(t, action="fail", ret=-5, every=1))
        try:
            assert eng.mechanism == "signal", eng.signal_refusal
            assert not eng.start_warnings
            rows = t.victim(3)
            eng.drain()
        finally:
            eng.close()
    finally:
        t.close()
    assert [r[3] for r in rows] == [-5, -5, -5]
    caps = _caps(db)
    assert caps["signal"] is True and caps["mechanism"] == "auto" and "signal_refusal" not in caps
    con = sqlite3.connect(db)
    outs = [(m, json.loads(o)) for m, o in con.execute("SELECT mechanism, outcome FROM faults")]
    assert len(outs) == 3
    for mech, o in outs:
        assert mech == "signal"
        assert o["helper"] == {"signal": "SIGURG", "handled": 3, "inert": 0, "foreign": 0,
                               "stray": 0}  # fmt: skip
        assert o["injected"] is True


@root
@needs_target
def test_gpufault_signal_0_and_mechanism_copilot_force_the_copilot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = Target()
    try:
        monkeypatch.setenv("GPUFAULT_SIGNAL", "0")
        eng = _default_engine(t, tmp_path / "a.db", _victim_spec(t, action="fail", ret=-5, nth=1))
        try:
            assert eng.mechanism == "copilot" and not eng.start_warnings
            assert [r[3] for r in t.victim(2)] == [-5, 3]
        finally:
            eng.close()
        monkeypatch.delenv("GPUFAULT_SIGNAL")
        eng = _default_engine(t, tmp_path / "b.db", _victim_spec(t, action="fail", ret=-6, nth=1),
                              mechanism="copilot")  # fmt: skip
        try:
            assert eng.mechanism == "copilot" and not eng.start_warnings
            assert [r[3] for r in t.victim(2)] == [-6, 3]
        finally:
            eng.close()
        assert not _helper_mapped(t.pid)
    finally:
        t.close()
    caps = _caps(tmp_path / "b.db")
    assert caps["signal"] is False and caps["mechanism"] == "copilot"
    assert "--mechanism copilot" in caps["signal_refusal"]


@root
@needs_target
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_seccomp_filtered_target_falls_back_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seccomp: 2: refused before any ptrace call the filter could kill the
    target for; the copilot carries the run, the reason in the run row and
    one start-up warning; nothing of the helper in the target."""
    monkeypatch.delenv("GPUFAULT_SIGNAL", raising=False)
    t = _seccomp_target(tmp_path)
    db = tmp_path / "gf.db"
    try:
        eng = _default_engine(t, db, _victim_spec(t, action="fail", ret=-5, every=1))
        try:
            assert eng.mechanism == "copilot"
            assert len(eng.start_warnings) == 1 and "seccomp" in eng.start_warnings[0]
            rows = t.victim(3)
            eng.drain()
        finally:
            eng.close()
        assert not _helper_mapped(t.pid)
    finally:
        t.close()
    assert [r[3] for r in rows] == [-5, -5, -5]
    caps = _caps(db)
    assert caps["signal"] is False and "seccomp filter" in caps["signal_refusal"]
    con = sqlite3.connect(db)
    assert {m for (m,) in con.execute("SELECT mechanism FROM faults")} == {"copilot"}


def _run_cli(pid: int, db: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GPUFAULT_SIGNAL"}
    argv = [sys.executable, "-m", "pyctl", *on_victim("inject", pid), "--action", "fail"]
    argv += ["--ret", "-7", "--no-stack", "--db", str(db), "--duration", "5s", *extra]
    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)


@root
@needs_target
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_mechanism_signal_refuses_in_one_line_leaving_nothing(tmp_path: Path) -> None:
    """`--mechanism signal` on a target the trial refuses (a seccomp filter):
    one line, a non-zero exit, no database, the target not traced, nothing
    mapped into it and its signal state as before."""
    t = _seccomp_target(tmp_path)
    db = tmp_path / "gf.db"
    try:
        before = _sig_masks(t.pid)
        r = _run_cli(t.pid, db, "--mechanism", "signal")
        after = _sig_masks(t.pid)
        mapped = _helper_mapped(t.pid)
        rows = t.victim(2)
    finally:
        t.close()
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--mechanism signal" in lines[0] and "seccomp" in lines[0], lines
    assert after == before and after["TracerPid"] == "0" and not mapped
    assert not db.exists()
    assert [x[3] for x in rows] == [2, 3]
    bad = _run_cli(os.getpid(), db, "--mechanism", "fast")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


@root
@needs_target
def test_cli_mechanism_copilot_forces_the_copilot(tmp_path: Path) -> None:
    """`gpufault inject --mechanism copilot` on a target the helper could
    serve: the copilot's fault rows, no helper loaded."""
    t = Target()
    db = tmp_path / "gf.db"
    try:
        argv = [sys.executable, "-m", "pyctl", *on_victim("inject", t.pid), "--action", "fail",
                "--ret", "-7", "--no-stack", "--db", str(db), "--mechanism", "copilot"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "GPUFAULT_SIGNAL"}
        ctl, lines = start_controller(argv, env=env, cwd=REPO)
        rows = t.victim(4)
        ctl.send_signal(signal.SIGINT)
        _, err = finish(ctl, 60)
        mapped = _helper_mapped(t.pid)
    finally:
        t.close()
    assert ctl.returncode == 0, err
    assert "mechanism copilot" in "".join(lines)
    assert [r[3] for r in rows] == [-7] * 4 and not mapped
    con = sqlite3.connect(db)
    assert {m for (m,) in con.execute("SELECT mechanism FROM faults")} == {"copilot"}


@root
@needs_target
def test_specs_the_helper_cannot_carry_stay_on_the_copilot_in_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fail-skip (the helper's) and a fail after the body (the copilot's)
    in one run: each fault row names its mechanism, both values reach the
    target, the helper takes a signal of its own (SIGWINCH, which the
    copilot passes on), and the run row says which spec the copilot kept."""
    monkeypatch.delenv("GPUFAULT_SIGNAL", raising=False)
    t = Target()
    db = tmp_path / "gf.db"
    try:
        t.victim(1, threads=2)  # glibc's thread handlers in place before the baseline
        before = _sig_masks(t.pid)
        skip = _victim_spec(t, action="fail", ret=-5, every=1)
        after = _victim_spec(t, action="fail", mode="after", ret=-9, every=1)
        after.fn = "gf_alloc"
        eng = _default_engine(t, db, skip, after)
        try:
            assert eng.mechanism == "signal+copilot", eng.signal_refusal
            assert eng.helper.signo == signal.SIGWINCH and not eng.start_warnings
            rows = t.victim(3)
            allocs = t.alloc(2)
            eng.drain()
        finally:
            eng.close()
        assert _sig_masks(t.pid) == before
    finally:
        t.close()
    assert [r[3] for r in rows] == [-5, -5, -5]
    assert [a[1] for a in allocs] == [-9, -9]
    con = sqlite3.connect(db)
    got = sorted(con.execute("SELECT function, mechanism FROM faults"))
    assert got == [("gf_alloc", "copilot")] * 2 + [("gf_victim", "signal")] * 3
    caps = _caps(db)
    assert caps["signal"] is True and caps["helper_signal"] == signal.SIGWINCH
    assert "fail after the body" in caps["signal_copilot_specs"]["1"]
    assert eng.signal_counters["handled"] == 3


@root
@needs_target
def test_api_mechanism_keyword(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpufault.arm(mechanism=...): copilot forces it, signal refuses one
    line on a hang it cannot carry, a bad value is BadInput."""
    import gpufault
    from gpufault import BadInput, Fault, GpufaultError

    monkeypatch.delenv("GPUFAULT_SIGNAL", raising=False)
    t = Target()
    try:
        f = Fault.fail(str(LIB), "gf_victim", ret=-4, nth=1)
        with gpufault.arm(f, t.pid, db=tmp_path / "a.db") as h:
            assert h.mechanism == "signal"
            assert [r[3] for r in t.victim(2)] == [-4, 3]
        with gpufault.arm(f, t.pid, db=tmp_path / "b.db", mechanism="copilot") as h:
            assert h.mechanism == "copilot"
            assert [r[3] for r in t.victim(2)] == [-4, 3]
        with pytest.raises(GpufaultError, match="--mechanism signal: a stall with no length"):
            gpufault.arm(Fault.hang(str(LIB), "gf_victim"), t.pid, db=tmp_path / "c.db",
                         mechanism="signal")  # fmt: skip
        assert not (tmp_path / "c.db").exists()
        with pytest.raises(BadInput, match="mechanism"):
            gpufault.arm(f, t.pid, db=tmp_path / "d.db", mechanism="fast")
    finally:
        t.close()


@root
def test_doctor_says_which_mechanism_this_kernel_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    """`default mechanism`: signal by trial where BPF cannot write registers
    (this kernel), the copilot once GPUFAULT_SIGNAL=0 turns it off."""
    from pyctl.api import doctor
    from pyctl.capabilities import regs_writable

    def line() -> str:
        (c,) = [c for c in doctor.checks() if c.name == "default mechanism"]
        return c.detail

    monkeypatch.delenv("GPUFAULT_SIGNAL", raising=False)
    want = "regs" if regs_writable() else "signal, by trial"
    assert line().startswith(want), line()
    if not regs_writable():
        assert "seccomp" in line() and "--mechanism copilot" in line()
        monkeypatch.setenv("GPUFAULT_SIGNAL", "0")
        assert line().startswith("copilot: GPUFAULT_SIGNAL=0"), line()
