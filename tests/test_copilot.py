"""ptrace copilot on real processes (root): fail (skip, after), stall,
release, pass-through, group-stop, fork, exec, exits, refusals, stop().

The targets (tests/targets/copilot_target.c) raise the copilot's signal in
their own threads, so these tests need ptrace but not the BPF engine.
PendingDouble is a test double for the BPF "pending" map: it builds the
Injection from the registers at the stop (the victim keeps its entry sp)
plus the callee-saved values the caller set, which the victim clobbered.
"""

from __future__ import annotations

import ctypes
import os
import queue
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pyctl.copilot import (
    GF_ACT_FAIL,
    GF_ACT_STALL,
    GF_F_AFTER,
    Copilot,
    CopilotError,
    Injection,
    Outcome,
    procfs,
    ptrace,
)

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "tests" / "targets" / "copilot_target.c"
BODY_RET = 1000
# Values the target's harness puts in the callee-saved registers (pt_regs
# order r15 r14 r13 r12 bp bx); victim_skip zeroes them before its stop.
CALLEE_SAVED = {
    0: 0x1515151515151515,
    1: 0x1414141414141414,
    2: 0x1313131313131313,
    3: 0x1212121212121212,
    4: 0x0B0B0B0B0B0B0B0B,
    5: 0x0A0A0A0A0A0A0A0A,
}
TIMEOUT = 10.0

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="requires root (ptrace of other processes)"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 registers only"),
]


@pytest.fixture(scope="session")
def target_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("requires gcc to build tests/targets/copilot_target.c")
    exe = tmp_path_factory.mktemp("copilot") / "copilot_target"
    subprocess.run(["gcc", "-O2", "-Wall", "-pthread", "-o", str(exe), str(SOURCE)], check=True)
    return exe


class Target:
    """A running copilot_target; line protocol over stdin/stdout."""

    def __init__(self, exe: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [str(exe), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._backlog: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = int(self.expect("ready")["pid"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def expect(self, tag: str, timeout: float = TIMEOUT) -> dict[str, str]:
        """The next line starting with tag, as {key: value} (words: {"args": ...})."""
        for i, line in enumerate(self._backlog):
            if line.split(" ", 1)[0] == tag:
                del self._backlog[i]
                return parse(line)
        end = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {tag!r} line; seen {self._backlog}") from None
            if line is None:
                raise AssertionError(f"target ended before {tag!r}; seen {self._backlog}")
            if line.split(" ", 1)[0] == tag:
                return parse(line)
            self._backlog.append(line)

    def has_line(self, tag: str) -> bool:
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self._backlog.append(line)
        return any(line.split(" ", 1)[0] == tag for line in self._backlog)

    def ask(self, cmd: str, tag: str | None = None) -> dict[str, str]:
        self.send(cmd)
        return self.expect(tag or cmd.split()[0])

    def close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        for pid in (self.pid, self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def parse(line: str) -> dict[str, str]:
    out: dict[str, str] = {}
    words = []
    for word in line.split()[1:]:
        key, eq, value = word.partition("=")
        if eq:
            out[key] = value
        else:
            words.append(word)
    out["args"] = " ".join(words)
    return out


class PendingDouble:
    """Test double for the BPF pending map: arm(n) makes the next n stops
    of the signal injections of this kind (fetch consumes one each)."""

    def __init__(
        self,
        action: int = GF_ACT_FAIL,
        retval: int = -77,
        flags: int = 0,
        stall_ns: int = 0,
        deadline_ns: int = 0,
    ) -> None:
        self.action, self.retval, self.flags = action, retval, flags
        self.stall_ns, self.deadline_ns = stall_ns, deadline_ns
        self.armed = 0
        self.seq = 0
        self.fetched = threading.Event()
        self.hook: Callable[[int], None] | None = None

    def arm(self, n: int = 1) -> None:
        self.armed = n

    def fetch(self, tid: int) -> Injection | None:
        if self.armed <= 0:
            return None
        try:
            regs = list(ptrace.getregs(tid)[:21])
        except OSError:
            return None  # not stopped: the copilot's clean-up call at thread exit
        for i, value in CALLEE_SAVED.items():
            regs[i] = value
        self.armed -= 1
        self.seq += 1
        if self.hook:
            self.hook(tid)
        self.fetched.set()
        return Injection(
            self.seq,
            tuple(regs),
            self.retval,
            self.stall_ns,
            self.deadline_ns,
            self.action,
            self.flags,
        )


class Run:
    """A target with a copilot attached, and the outcomes it reported."""

    def __init__(
        self, exe: Path, double: PendingDouble, *args: str, signo: int = signal.SIGURG
    ) -> None:
        self.target = Target(exe, "--signo", str(signo), *args)
        self.double = double
        self._outcomes: list[Outcome] = []
        self._cv = threading.Condition()
        self.copilot = Copilot(self.target.pid, signo, double.fetch, self._record)
        self.copilot.start()

    def _record(self, outcome: Outcome) -> None:
        with self._cv:
            self._outcomes.append(outcome)
            self._cv.notify_all()

    def wait_outcomes(self, n: int) -> list[Outcome]:
        """Outcomes are reported just after the thread resumes: wait for n."""
        with self._cv:
            assert self._cv.wait_for(lambda: len(self._outcomes) >= n, TIMEOUT), self._outcomes
            return list(self._outcomes)


@pytest.fixture
def run(target_exe: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def make(double: PendingDouble | None = None, *args: str, **kw: int) -> Run:
        r = Run(target_exe, double or PendingDouble(), *args, **kw)
        runs.append(r)
        return r

    yield make
    for r in runs:
        r.copilot.stop()
        r.target.close()


def tracer_of(pid: int) -> dict[int, tuple[int, str]]:
    """{tid: (TracerPid, state)} for every thread of pid."""
    out = {}
    for tid in procfs.tids(pid):
        try:
            out[tid] = (procfs.tracer_pid(pid, tid), procfs.thread_state(pid, tid))
        except OSError:
            pass
    return out


def assert_untraced_and_running(pid: int) -> None:
    for tid, (tracer, state) in tracer_of(pid).items():
        assert tracer == 0, f"thread {tid} still traced by {tracer}"
        assert state not in "tT", f"thread {tid} left stopped ({state})"


def assert_target_carries_on(t: Target) -> None:
    """Nothing traced or stopped, the next call runs, and the target exits 0."""
    assert_untraced_and_running(t.pid)
    assert t.ask("skip")["ret"] == str(BODY_RET)
    t.close()
    assert t.expect("status") == {"exited": "0", "args": ""}


# ---- fail ----


def test_skip_returns_injected_value_without_running_body(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(retval=-77))
    r.double.arm(1)
    got = r.target.ask("skip")
    assert (got["ret"], got["body"], got["regs"]) == ("-77", "0", "1")
    # The process lives on and later calls run normally.
    got = r.target.ask("skip")
    assert (got["ret"], got["body"], got["regs"]) == (str(BODY_RET), "1", "1")
    (o,) = r.wait_outcomes(1)
    assert o.error is None and o.action == GF_ACT_FAIL and o.fault_seq == 1
    assert o.tid == r.target.pid and o.ret_addr != 0 and o.ip_after == o.ret_addr
    assert o.stop_ns <= o.resume_ns
    r.copilot.stop()
    r.target.close()
    assert r.target.expect("status") == {"exited": "0", "args": ""}


def test_skip_many_times_in_a_row(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(retval=-2))
    r.double.arm(50)
    got = r.target.ask("loop 50", "loop")
    # bad counts calls that did not return BODY_RET with the body run: all 50.
    assert got["bad"] == "50"
    outs = r.wait_outcomes(50)
    assert len(outs) == 50 and all(o.error is None for o in outs)
    assert r.target.ask("skip")["ret"] == str(BODY_RET)


def test_after_mode_replaces_return_value_after_body(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(retval=-5, flags=GF_F_AFTER))
    r.double.arm(1)
    got = r.target.ask("after")
    assert (got["ret"], got["body"], got["regs"]) == ("-5", "1", "1")
    assert r.target.ask("after")["ret"] == "0"  # the function's own result
    (o,) = r.wait_outcomes(1)
    assert o.error is None and o.ret_addr == 0 and o.ip_before == o.ip_after


def test_refuses_skip_when_stack_moved(run: Callable[..., Run]) -> None:
    """A stale entry (sp far from the stop's) is refused, the call runs."""
    double = PendingDouble(retval=-77)
    r = run(double)
    real_fetch = double.fetch

    def stale(tid: int) -> Injection | None:
        inj = real_fetch(tid)
        if inj is None:
            return None
        regs = list(inj.regs)
        regs[ptrace.REG["sp"]] += 1 << 20
        return Injection(inj.fault_seq, tuple(regs), inj.retval, 0, 0, inj.action, 0)

    r.copilot._fetch = stale  # swap before the first stop
    double.arm(1)
    got = r.target.ask("skip")
    assert (got["ret"], got["body"]) == (str(BODY_RET), "1")
    (o,) = r.wait_outcomes(1)
    assert o.error and "sp moved" in o.error


def _file_offset(exe: Path, symbol: str) -> int:
    from elftools.elf.elffile import ELFFile

    with open(exe, "rb") as f:
        elf = ELFFile(f)
        symtab = elf.get_section_by_name(".symtab")
        value = symtab.get_symbol_by_name(symbol)[0]["st_value"]
        for seg in elf.iter_segments():
            if seg["p_type"] == "PT_LOAD" and 0 <= value - seg["p_vaddr"] < seg["p_filesz"]:
                return int(value - seg["p_vaddr"] + seg["p_offset"])
    raise AssertionError(f"{symbol} not in a loaded segment")


def _open_uretprobe(pid: int, exe: Path, symbol: str) -> int:
    """A uretprobe through perf_event_open (no BPF): the kernel hijacks the
    return address of every call of symbol in pid with its trampoline."""
    kind = Path("/sys/bus/event_source/devices/uprobe/type")
    if not kind.exists():
        pytest.skip("kernel lacks the uprobe PMU (CONFIG_UPROBE_EVENTS)")
    path = ctypes.create_string_buffer(str(exe).encode())
    attr = bytearray(72)  # struct perf_event_attr, PERF_ATTR_SIZE_VER1
    struct.pack_into("=IIQ", attr, 0, int(kind.read_text()), len(attr), 1)  # config:0 retprobe
    struct.pack_into("=QQ", attr, 56, ctypes.addressof(path), _file_offset(exe, symbol))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(
        ctypes.c_long(298),
        (ctypes.c_char * len(attr)).from_buffer(attr),
        ctypes.c_int(pid),
        ctypes.c_int(-1),
        ctypes.c_int(-1),
        ctypes.c_ulong(0),
    )
    if fd < 0:
        raise OSError(ctypes.get_errno(), "perf_event_open(uretprobe)")
    return int(fd)


def test_skip_returns_through_uretprobe_trampoline(
    run: Callable[..., Run], target_exe: Path
) -> None:
    """With a uretprobe attached, the word at entry sp is the kernel's
    trampoline by the time of the stop: returning through it keeps the
    kernel's return-instance stack right and fires the return probe."""
    r = run(PendingDouble(retval=-77))
    fd = _open_uretprobe(r.target.pid, target_exe, "victim_skip")
    try:
        r.double.arm(1)
        got = r.target.ask("skip")
        assert (got["ret"], got["body"], got["regs"]) == ("-77", "0", "1")
        (o,) = r.wait_outcomes(1)
        maps = Path(f"/proc/{r.target.pid}/maps").read_text().splitlines()
        (uprobes,) = [line.split()[0] for line in maps if line.endswith("[uprobes]")]
        lo, hi = (int(x, 16) for x in uprobes.split("-"))
        assert lo <= o.ret_addr < hi, f"{o.ret_addr:#x} not in [uprobes] {uprobes}"
        assert struct.unpack("=Q", os.read(fd, 8))[0] == 1  # the return probe fired
        got = r.target.ask("skip")  # a normal call through the probe afterwards
        assert (got["ret"], got["body"], got["regs"]) == (str(BODY_RET), "1", "1")
        assert struct.unpack("=Q", os.read(fd, 8))[0] == 2
    finally:
        os.close(fd)


# ---- stall ----


def test_stall_only_stops_the_target_thread_until_released(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(action=GF_ACT_STALL, stall_ns=0))
    r.target.ask("workers 2", "workers")
    r.double.arm(1)
    r.target.send("thread skip")  # a thread created after attach
    tid = int(r.target.expect("begin")["tid"])
    assert r.copilot.wait_stalled(1, timeout=TIMEOUT) == [tid]
    assert procfs.thread_state(r.target.pid, tid) == "t"
    # Everyone else makes progress meanwhile: the main thread answers, and
    # both workers' counters move between two answers.
    first = [int(c) for c in r.target.ask("counters")["args"].split()]
    for _ in range(1000):
        now = [int(c) for c in r.target.ask("counters")["args"].split()]
        if all(n > f for n, f in zip(now, first, strict=True)):
            break
    else:
        raise AssertionError(f"workers made no progress: {first} -> {now}")
    assert not r.target.has_line("end")  # the stalled call has not returned
    assert r.copilot.stalled() == [tid]
    assert r.copilot.release(tid) == 1
    got = r.target.expect("end")
    assert (got["ret"], got["body"], got["regs"]) == (str(BODY_RET), "1", "1")
    (o,) = r.wait_outcomes(1)
    assert o.error is None and o.action == GF_ACT_STALL and o.resume_ns > o.stop_ns
    assert r.copilot.stalled() == [] and r.copilot.release() == 0


def test_stall_20ms_median_measured_inside_target(run: Callable[..., Run]) -> None:
    n = 15
    r = run(PendingDouble(action=GF_ACT_STALL, stall_ns=20_000_000))
    r.double.arm(n)
    got = r.target.ask(f"loop {n}", "loop")
    assert got["bad"] == "0"
    ms = sorted(int(x) / 1e6 for x in got["args"].split())
    med = statistics.median(ms)
    print(f"stall 20 ms, {n} calls: median {med:.3f} ms, min {ms[0]:.3f}, max {ms[-1]:.3f}")
    assert 18.0 <= med <= 22.0, ms


def test_stall_ends_at_spec_deadline(run: Callable[..., Run]) -> None:
    double = PendingDouble(action=GF_ACT_STALL, stall_ns=0)
    r = run(double)
    double.deadline_ns = time.monotonic_ns() + 30_000_000
    double.arm(1)
    got = r.target.ask("skip")
    assert got["ret"] == str(BODY_RET)
    (o,) = r.wait_outcomes(1)
    assert o.error is None and o.resume_ns >= double.deadline_ns


def test_release_all(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(action=GF_ACT_STALL))
    r.double.arm(2)
    r.target.send("thread skip")
    r.target.send("thread skip")
    assert len(r.copilot.wait_stalled(2, timeout=TIMEOUT)) == 2
    assert r.copilot.release() == 2
    assert r.target.expect("end")["ret"] == str(BODY_RET)
    assert r.target.expect("end")["ret"] == str(BODY_RET)


# ---- signals that are not ours ----


def test_genuine_signals_pass_through(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(retval=-77), "--handle")
    os.kill(r.target.pid, signal.SIGURG)  # no pending entry: a real SIGURG
    os.kill(r.target.pid, signal.SIGUSR1)
    for _ in range(1000):
        got = r.target.ask("sigs")
        if got["sig"] == "1" and got["usr1"] == "1":
            break
    assert (got["sig"], got["usr1"]) == ("1", "1")
    # An injection on a target that handles the signal: the handler never sees it.
    r.double.arm(1)
    assert r.target.ask("skip")["ret"] == "-77"
    assert r.target.ask("sigs")["sig"] == "1"


def test_group_stop_and_continue(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(retval=-9))
    r.target.ask("workers 1", "workers")
    os.kill(r.target.pid, signal.SIGSTOP)
    _wait_for(
        lambda: all(s == "t" for _, s in tracer_of(r.target.pid).values()),
        "all threads group-stopped",
    )
    os.kill(r.target.pid, signal.SIGCONT)
    r.double.arm(1)
    assert r.target.ask("skip")["ret"] == "-9"


def _wait_for(cond: Callable[[], bool], what: str) -> None:
    # /proc state has no change notification: re-read with a short back-off.
    end = time.monotonic() + TIMEOUT
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.002)


# ---- fork, exec, exit ----


def test_fork_child_is_not_followed(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(retval=-77))
    r.double.arm(1)
    got = r.target.ask("fork")
    # The child raised the signal untraced: ignored, its body ran, nothing consumed.
    assert (got["exited"], got["code"]) == ("1", "0")
    assert r.double.armed == 1
    assert r.target.ask("skip")["ret"] == "-77"


def test_exec_from_a_thread_keeps_tracing(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(retval=-33))
    r.target.send("exec")
    assert int(r.target.expect("ready")["pid"]) == r.target.pid
    r.double.arm(1)
    got = r.target.ask("skip")
    assert (got["ret"], got["body"], got["regs"]) == ("-33", "0", "1")
    assert r.target.ask("skip")["ret"] == str(BODY_RET)
    assert procfs.tracer_pid(r.target.pid) == r.copilot._tracer_tid
    r.copilot.stop()
    assert_untraced_and_running(r.target.pid)


def test_target_exits_during_stall(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(action=GF_ACT_STALL))
    r.double.arm(1)
    r.target.send("thread skip")
    r.copilot.wait_stalled(1, timeout=TIMEOUT)
    r.target.send("exit 7")
    assert r.target.expect("status") == {"exited": "7", "args": ""}
    assert r.copilot._thread is not None
    r.copilot._thread.join(TIMEOUT)
    assert not r.copilot.running and r.copilot.stalled() == []
    assert r.copilot.exit_status is not None and os.WEXITSTATUS(r.copilot.exit_status) == 7
    (o,) = r.wait_outcomes(1)
    assert o.error == "thread exited during stall"
    r.copilot.stop()  # nothing left: no error


def test_target_killed_while_fail_in_flight(run: Callable[..., Run]) -> None:
    double = PendingDouble(retval=-77)
    r = run(double)
    double.hook = lambda tid: os.kill(r.target.pid, signal.SIGKILL)
    double.arm(1)
    r.target.send("skip")
    assert r.target.expect("status") == {"signaled": "9", "args": ""}
    assert r.copilot._thread is not None
    r.copilot._thread.join(TIMEOUT)
    assert not r.copilot.running
    assert [o.error for o in r.wait_outcomes(1)] == ["thread exited at the stop"]


# ---- stop ----


def test_stop_resumes_stalled_and_detaches_all(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(action=GF_ACT_STALL))
    r.target.ask("workers 2", "workers")
    r.double.arm(1)
    r.target.send("thread skip")
    r.copilot.wait_stalled(1, timeout=TIMEOUT)
    r.target.ask("workers 1", "workers")  # a third worker, created after attach
    r.copilot.stop()
    r.copilot.stop()  # idempotent
    assert r.target.expect("end")["ret"] == str(BODY_RET)
    assert_untraced_and_running(r.target.pid)
    assert [o.error for o in r.wait_outcomes(1)] == ["ended by stop()"]
    assert r.target.ask("skip")["ret"] == str(BODY_RET)  # signal now ignored
    r.target.close()
    assert r.target.expect("status") == {"exited": "0", "args": ""}


def test_context_manager(target_exe: Path) -> None:
    t = Target(target_exe)
    try:
        double = PendingDouble(retval=-1)
        with Copilot(t.pid, signal.SIGURG, double.fetch) as cp:
            double.arm(1)
            assert t.ask("skip")["ret"] == "-1"
            assert cp.running
        assert not cp.running
        assert_untraced_and_running(t.pid)
    finally:
        t.close()


# ---- refusals ----


def test_already_traced_target_is_refused(target_exe: Path) -> None:
    if shutil.which("strace") is None:
        pytest.skip("requires strace as the second tracer")
    t = Target(target_exe)
    strace = subprocess.Popen(["strace", "-q", "-f", "-o", "/dev/null", "-p", str(t.pid)])
    try:
        _wait_for(lambda: procfs.tracer_pid(t.pid) == strace.pid, "strace has attached")
        with pytest.raises(CopilotError) as err:
            Copilot(t.pid, signal.SIGURG, lambda tid: None).start()
        msg = str(err.value)
        assert "already traced by pid" in msg and "strace" in msg and "\n" not in msg
    finally:
        strace.terminate()
        strace.wait()
        t.close()


def test_dead_pid_is_refused() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(CopilotError, match=f"pid {proc.pid}: no such process"):
        Copilot(proc.pid, signal.SIGURG, lambda tid: None).start()


def test_missing_cap_sys_ptrace_is_refused(target_exe: Path) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("requires setpriv (util-linux) to drop CAP_SYS_PTRACE")
    t = Target(target_exe)
    try:
        code = (
            "import signal, sys\n"
            "from pyctl.copilot import Copilot, CopilotError\n"
            "try:\n"
            f"    Copilot({t.pid}, signal.SIGURG, lambda tid: None).start()\n"
            "except CopilotError as e:\n"
            "    print(e); sys.exit(3)\n"
        )
        out = subprocess.run(
            [
                "setpriv",
                "--bounding-set=-sys_ptrace",
                "--inh-caps=-sys_ptrace",
                sys.executable,
                "-c",
                code,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 3, out.stderr
        assert out.stdout.startswith(f"not permitted to ptrace pid {t.pid}")
        assert procfs.tracer_pid(t.pid) == 0
    finally:
        t.close()


def test_own_child_target_exit_status_is_kept(target_exe: Path) -> None:
    """A target started by the controller itself (gpufault run -- CMD): the
    copilot reaps it, so its exit status comes from Copilot.exit_status."""
    child = subprocess.Popen(
        [str(target_exe), "--no-supervise"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().startswith("ready")
        double = PendingDouble(retval=-4)
        cp = Copilot(child.pid, signal.SIGURG, double.fetch)
        cp.start()
        assert any("this process's child" in w for w in cp.warnings)
        double.arm(1)
        child.stdin.write("skip\nexit 5\n")
        child.stdin.flush()
        assert child.stdout.readline().split()[1] == "ret=-4"
        assert cp._thread is not None
        cp._thread.join(TIMEOUT)  # the copilot ends when its target has gone
        assert cp.exit_status is not None and os.WIFEXITED(cp.exit_status)
        assert os.WEXITSTATUS(cp.exit_status) == 5
    finally:
        child.kill()
        child.wait()


def test_warns_about_a_signal_that_is_not_ignored_by_default(run: Callable[..., Run]) -> None:
    r = run(PendingDouble(retval=-6), signo=signal.SIGUSR2)
    assert any("not ignored by default" in w for w in r.copilot.warnings)
    r.double.arm(1)
    assert r.target.ask("skip")["ret"] == "-6"  # works all the same
