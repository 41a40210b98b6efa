"""The copilot: one dedicated thread that has seized every thread of the
target with ptrace and finishes injections at signal-delivery-stops.

BPF writes a pending entry for a thread and sends it `signo` (default
action: ignore). The thread stops before the signal is delivered; the
tracer fetches (and so deletes) the entry, rewrites registers (fail) or
keeps the thread stopped (stall), and resumes it with the signal
suppressed. Everything else passes through untouched.

Why the shapes below:
- ptrace requests must come from the thread that seized the tracee, so
  every request runs on the tracer thread; other threads send it commands.
- The tracer sleeps in sigtimedwait(SIGCHLD) with SIGCHLD blocked in its
  thread (the kernel sends SIGCHLD for every tracee stop), then reaps with
  waitpid(-1, WNOHANG | __WALL | __WNOTHREAD). __WNOTHREAD keeps it to this
  thread's tracees, so the controller's other children are never reaped.
  Commands wake it with a thread-directed SIGCHLD.
- Never PTRACE_O_EXITKILL: when the tracer thread dies, the kernel detaches
  every tracee and a pending stop signal is delivered, i.e. ignored.
- While a stall with an end is in progress, a watchdog timer (watchdog.py)
  kills the controller if it is still hung WATCHDOG_GRACE_NS after the
  latest planned end, so the stalled threads resume even then.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from pyctl import heldcalls, procstate, threadsched
from pyctl.sigmask import SIGCHLD_SET

from . import errno_tls, procfs, ptrace, rewrite
from .model import GF_ACT_FAIL, GF_ACT_STALL, GF_F_AFTER, CopilotError, Injection, Outcome
from .watchdog import Watchdog

log = logging.getLogger(__name__)

OPTIONS = ptrace.PTRACE_O_TRACECLONE | ptrace.PTRACE_O_TRACEEXEC
WAIT_FLAGS = os.WNOHANG | ptrace.WALL | ptrace.WNOTHREAD
# Signals whose default action is to ignore (SIGCONT also continues).
DEFAULT_IGNORED = frozenset({signal.SIGURG, signal.SIGWINCH, signal.SIGCHLD, signal.SIGCONT})
STOP_SIGNALS = frozenset({signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})
# The kernel sends SIGCHLD for a tracee stop to the whole controller
# process. If it comes in the instant between our last waitpid and
# sigtimedwait, another controller thread that does not block SIGCHLD can
# take it (and drop it: its default action is to ignore). waitpid still
# holds the stop, so a bounded wait turns that race into a delay of at most
# SAFETY_WAIT: short while tracees are busy (when the race can happen),
# longer when idle. Blocking SIGCHLD in every thread (block_sigchld() in
# the main thread before others start) removes the race.
SAFETY_WAIT_HOT_NS = 1_000_000
SAFETY_WAIT_IDLE_NS = 50_000_000
HOT_NS = 200_000_000
STOP_GRACE_NS = 2_000_000_000  # stop(): wait this long for threads to stop
# The watchdog kills the controller this long after the latest planned
# stall end if the tracer has not ended (and disarmed) it by then. A live
# tracer ends a stall within milliseconds of its end (its sleep is bounded
# by the end; the latest end measured on the loaded VM was 52 ms late, GIL
# hand-over adds up to 5 ms), so 2 s is over 30x that worst case and a slow
# but live controller is never killed. It is also the most a stall can
# overrun its end when the controller hangs.
WATCHDOG_GRACE_NS = 2_000_000_000
REG_IP = ptrace.REG["ip"]
REG_FS_BASE = ptrace.REG["fs_base"]


@dataclass
class _Stall:
    inj: Injection
    stop_ns: int
    until_ns: int | None  # CLOCK_MONOTONIC; None = until released
    ip: int


@dataclass
class _Cmd:
    name: str
    arg: int | None
    done: threading.Event = field(default_factory=threading.Event)
    result: int = 0


class Copilot:
    """ptrace copilot for one target process. See docs/copilot.md."""

    def __init__(
        self,
        pid: int,
        signo: int,
        fetch: Callable[[int], Injection | None],
        on_outcome: Callable[[Outcome], None] | None = None,
        watchdog_grace_ns: int | None = WATCHDOG_GRACE_NS,
    ) -> None:
        """watchdog_grace_ns None: no watchdog (a hung controller then keeps
        stalled threads stopped until it dies)."""
        self.pid = pid
        self.signo = signo
        self._fetch = fetch
        self._on_outcome = on_outcome
        self.warnings: list[str] = []
        self.exit_status: int | None = None  # wait status of the leader's exit
        self._thread: threading.Thread | None = None
        self._tracer_tid = 0
        self._ready = threading.Event()
        self._start_error: CopilotError | None = None
        self._cmds: queue.SimpleQueue[_Cmd] = queue.SimpleQueue()
        self._threads: set[int] = set()  # tracer thread only
        self._stalls: dict[int, _Stall] = {}  # tracer thread only
        self._stopping = False
        self._stop_deadline = 0
        self._cv = threading.Condition()  # guards _stalled_view
        self._stalled_view: list[int] = []
        self._finished = False
        self._last_event_ns = 0
        self._watchdog_grace_ns = watchdog_grace_ns
        self.watchdog: Watchdog | None = None  # created by the tracer thread at start
        # errno's offset from the thread pointer (errno_tls), found at the
        # first fail that sets errno and again after an exec (a new libc).
        self._errno_tpoff: int | None = None
        # /proc/PID/mem, kept open once errno is set: one pwrite per fail
        # (~9 us here), not an open, a write and a close; closed at exec (a
        # new mm) and when the tracer ends.
        self._mem_fd: int | None = None

    # ---- public API (any thread) ----

    def start(self) -> None:
        """Seize every thread of the target; return once all are seized."""
        if self._thread is not None:
            raise CopilotError("copilot already started")
        self._precheck()
        self._thread = threading.Thread(target=self._run, name=f"copilot-{self.pid}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    def release(self, tid: int | None = None) -> int:
        """End stalls (all when tid is None); returns how many ended."""
        return self._command("release", tid)

    def stalled(self) -> list[int]:
        with self._cv:
            return list(self._stalled_view)

    def wait_stalled(self, count: int = 1, timeout: float | None = None) -> list[int]:
        """Block until at least count threads are stalled (or the copilot ends)."""
        with self._cv:
            self._cv.wait_for(lambda: len(self._stalled_view) >= count or self._finished, timeout)
            return list(self._stalled_view)

    @property
    def watchdog_expiry_ns(self) -> int | None:
        """CLOCK_MONOTONIC ns at which the watchdog kills this process if the
        stalls in progress have not ended by then; None when it is disarmed."""
        wd = self.watchdog
        return None if wd is None else wd.expiry_ns

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Resume stalled threads, detach from all; idempotent."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        if threading.get_native_id() == self._tracer_tid:
            self._begin_stop()  # from a callback: the loop finishes the job
            return
        self._command("stop", None)
        thread.join()

    def __enter__(self) -> Copilot:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---- checks before anything is attached ----

    def _precheck(self) -> None:
        pid = self.pid
        if pid <= 0:
            raise CopilotError(f"invalid pid {pid}: give the pid of a running process")
        if pid == os.getpid():
            raise CopilotError("the copilot cannot trace its own process")
        if not 1 <= self.signo < signal.NSIG or self.signo in (signal.SIGKILL, signal.SIGSTOP):
            raise CopilotError(f"signal {self.signo} cannot be used: pick e.g. SIGURG (23)")
        try:
            st = procfs.status(pid)
        except OSError:
            raise CopilotError(f"pid {pid}: no such process") from None
        # The leader's state is not the process's: after pthread_exit in main
        # it is Z while the other threads run. Only no live thread is a zombie.
        if st.get("State", "").startswith(("Z", "X")) and not procstate.alive(pid):
            raise CopilotError(f"pid {pid} has exited (zombie): nothing to trace")
        check_not_traced(pid)
        if self.signo not in DEFAULT_IGNORED:
            self.warnings.append(
                f"signal {self.signo} is not ignored by default: if the copilot dies with a "
                "fault in flight, the target gets it; SIGURG or SIGWINCH are safe"
            )
        if st.get("PPid") == str(os.getpid()):
            self.warnings.append(
                f"pid {pid} is this process's child: while the copilot runs, do not wait for it "
                "(Popen.poll/wait, waitpid): that takes its ptrace stops and leaves a thread "
                "stopped; the copilot reaps it and keeps its status in Copilot.exit_status"
            )
        mask = 1 << (self.signo - 1)
        try:
            caught = int(st.get("SigCgt", "0"), 16)
        except ValueError:
            caught = 0
        if caught & mask:
            self.warnings.append(
                f"pid {pid} handles signal {self.signo} (Go runtimes handle SIGURG): its "
                "handler runs if a fault fires while no copilot holds the thread; "
                "pick another with --copilot-signal (e.g. SIGWINCH)"
            )
        for tid in procfs.tids(pid):
            try:
                blocked = int(procfs.status(pid, tid).get("SigBlk", "0"), 16)
            except (OSError, ValueError):
                continue
            if blocked & mask:
                self.warnings.append(
                    f"thread {tid} blocks signal {self.signo}: its injections wait until it "
                    "unblocks it; pick another signal"
                )

    def _permission_error(self) -> CopilotError:
        scope = procfs.ptrace_scope()
        hint = "run as root or with CAP_SYS_PTRACE, as the target's uid"
        if scope is not None and scope >= 1:
            hint += f"; kernel.yama.ptrace_scope={scope} (needs CAP_SYS_PTRACE, 3 forbids ptrace)"
        return CopilotError(f"not permitted to ptrace pid {self.pid}: {hint}")

    # ---- tracer thread ----

    def _run(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        self._tracer_tid = threading.get_native_id()
        # A stopped target thread waits for this one to be scheduled: on a
        # busy host the fair scheduler lets it wait out another thread's
        # slice (0.75 ms x (1 + log2 CPUs)). A 0.1 ms EEVDF slice (Linux
        # 6.12+, no privilege; pyctl/threadsched.py) lets it preempt on
        # wake-up; it sleeps between stops. Not SCHED_FIFO: a real-time
        # thread in a harness's own process (gpufault.arm) is more than a
        # library should take.
        threadsched.short_slice()  # where the kernel has none: the default slice
        try:
            self._seize_all()
        except CopilotError as err:
            # Tracees seized so far are detached by the kernel when this
            # thread exits (they were never stopped, so nothing is pending).
            self._start_error = err
            self._finished = True
            self._ready.set()
            return
        self._start_watchdog()
        # The GIL back after each sigtimedwait within 0.5 ms, not 5, while
        # the controller's other threads are busy (pyctl/heldcalls.py).
        heldcalls.fast_switch_begin()
        self._ready.set()
        try:
            self._loop()
        except Exception:
            log.exception("copilot for pid %d failed; the kernel detaches its tracees", self.pid)
        finally:
            heldcalls.fast_switch_end()
            # Stalled threads resume when this thread ends (the kernel
            # detaches them if they were not resumed already).
            if self.watchdog is not None:
                try:
                    self.watchdog.close()
                except OSError:
                    log.exception("copilot: deleting the stall watchdog failed")
            self._stalls.clear()
            self._close_mem()
            self._finished = True
            self._publish()

    def _start_watchdog(self) -> None:
        if self._watchdog_grace_ns is None:
            return
        try:
            self.watchdog = Watchdog()  # on this thread: see Watchdog
        except OSError as exc:
            self.warnings.append(
                f"no stall watchdog ({exc.strerror}): if this process hangs, a stalled "
                "thread stays stopped until it dies"
            )

    def _sync_watchdog(self) -> None:
        """Arm at the latest planned stall end + grace; disarm when no stall
        in progress has an end (none, or only indefinite ones)."""
        wd = self.watchdog
        if wd is None or self._watchdog_grace_ns is None:
            return
        ends = [st.until_ns for st in self._stalls.values() if st.until_ns is not None]
        want = max(ends) + self._watchdog_grace_ns if ends else None
        if want == wd.expiry_ns:
            return
        try:
            if want is None:
                wd.disarm()
            else:
                wd.arm(want)
        except OSError:
            log.exception("copilot: stall watchdog failed")

    def _seize_all(self) -> None:
        seen: set[int] = set()
        while True:
            # Threads created by already-seized threads are attached by
            # TRACECLONE; others appear in the next listing: repeat until
            # a listing shows nothing new.
            tids = procfs.tids(self.pid)
            if not seen and self.pid not in tids:
                raise CopilotError(f"pid {self.pid}: no such process")
            new = sorted((t for t in tids if t not in seen), key=lambda t: t != self.pid)
            if not new:
                return
            for tid in new:
                seen.add(tid)
                self._seize(tid)

    def _seize(self, tid: int) -> None:
        try:
            ptrace.seize(tid, OPTIONS)
        except ProcessLookupError:
            if tid == self.pid:
                raise CopilotError(f"pid {self.pid}: no such process") from None
            return  # a thread that exited meanwhile
        except PermissionError:
            try:
                tracer = procfs.tracer_pid(self.pid, tid)
                state = procfs.thread_state(self.pid, tid)
            except OSError:
                return  # gone
            if tracer == self._tracer_tid:
                self._threads.add(tid)  # already ours through TRACECLONE
                return
            if state in "ZX":
                return  # a leader that called pthread_exit: nothing to stop
            if tracer:
                raise CopilotError(
                    f"pid {self.pid} is already traced by pid {tracer} ({_comm(tracer)}): "
                    "detach that debugger/tracer (gdb, strace) first"
                ) from None
            raise self._permission_error() from None
        self._threads.add(tid)

    def _loop(self) -> None:
        while True:
            self._run_commands()
            self._expire_stalls()
            # Reap last, just before sleeping: the window in which a stop
            # can lose its SIGCHLD to another thread (see SAFETY_WAIT_S) is
            # then only the call into sigtimedwait.
            if self._reap():
                continue
            if not self._threads:
                return  # target gone, or all detached by stop()
            if self._stopping and time.monotonic_ns() > self._stop_deadline:
                # Threads that never stopped (uninterruptible sleep): leave
                # them to the kernel, which detaches them as this thread exits.
                log.warning("copilot: threads %s did not stop; detaching on exit", self._threads)
                return
            signal.sigtimedwait(SIGCHLD_SET, self._next_timeout())

    def _next_timeout(self) -> float:
        now = time.monotonic_ns()
        hot = now - self._last_event_ns < HOT_NS
        wake = now + (SAFETY_WAIT_HOT_NS if hot else SAFETY_WAIT_IDLE_NS)
        for st in self._stalls.values():
            if st.until_ns is not None:
                wake = min(wake, st.until_ns)
        if self._stopping:
            wake = min(wake, self._stop_deadline)
        return max(0, wake - now) / 1e9

    def _reap(self) -> bool:
        """Handle every pending wait status; True if there was any."""
        seen = False
        while True:
            try:
                # heldcalls: keeps the GIL (WNOHANG: it never blocks).
                tid, status = heldcalls.waitpid(-1, WAIT_FLAGS)
            except ChildProcessError:
                self._threads.clear()  # no tracee left at all
                return seen
            if tid == 0:
                return seen
            seen = True
            self._last_event_ns = now = time.monotonic_ns()
            self._on_wait(tid, status, now)

    def _on_wait(self, tid: int, status: int, now: int) -> None:
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            if tid == self.pid:
                self.exit_status = status
            self._gone(tid, "exited")
            return
        if not os.WIFSTOPPED(status):
            return
        # A new thread's first stop can be seen before its parent's clone event.
        self._threads.add(tid)
        sig = os.WSTOPSIG(status)
        event = status >> 16
        if event == ptrace.PTRACE_EVENT_STOP:
            if sig in STOP_SIGNALS and not self._stopping:
                # Group-stop (SIGSTOP, ^Z): stay stopped, but let SIGCONT in.
                self._try(ptrace.listen, tid)
            else:
                # PTRACE_INTERRUPT, a new thread's first stop, or the trap
                # after SIGCONT ends a listened group-stop.
                self._resume(tid, 0)
        elif event == ptrace.PTRACE_EVENT_CLONE:
            child = self._try(ptrace.geteventmsg, tid)
            if child:
                self._threads.add(child)
            self._resume(tid, 0)
        elif event == ptrace.PTRACE_EVENT_EXEC:
            # The execing thread now has the leader's id; the old leader
            # and every other thread are gone (the others report exits).
            former = self._try(ptrace.geteventmsg, tid)
            self._errno_tpoff = None
            self._close_mem()
            if tid in self._stalls:
                self._drop_stall(tid, "thread replaced by exec during stall")
            if former and former != tid:
                self._gone(former, "replaced by exec")
            self._resume(tid, 0)
        elif event:
            self._resume(tid, 0)
        elif sig == self.signo:
            self._on_signal(tid, now)
        else:
            self._resume(tid, sig)  # not ours: deliver it

    def _on_signal(self, tid: int, now: int) -> None:
        try:
            inj = self._fetch(tid)
        except Exception as exc:
            log.exception("copilot: fetch(%d) failed", tid)
            self._emit(Outcome(tid, 0, 0, now, 0, 0, 0, 0, f"fetch failed: {exc}"))
            inj = None
        if inj is None:
            self._resume(tid, self.signo)  # a genuine signal: pass it through
            return
        if inj.action == GF_ACT_FAIL:
            self._fail(tid, inj, now)
        elif inj.action == GF_ACT_STALL:
            self._stall(tid, inj, now)
        else:
            self._resume(tid, 0)
            self._emit(
                Outcome(
                    tid,
                    inj.fault_seq,
                    inj.action,
                    now,
                    time.monotonic_ns(),
                    0,
                    0,
                    0,
                    f"unknown action {inj.action}",
                )
            )

    def _fail(self, tid: int, inj: Injection, now: int) -> None:
        error: str | None = None
        ip_before = ip_after = ret_addr = errno_addr = 0
        try:
            cur = ptrace.getregs(tid)
            ip_before = ip_after = cur[REG_IP]
            if inj.flags & GF_F_AFTER:
                new: list[int] | None = rewrite.after(cur, inj)
            else:
                error = rewrite.check_skip(cur, inj)
                new = None
                if error is None:
                    # Read now, not at entry: a uretprobe has since replaced
                    # the return address with its trampoline, and returning
                    # through it keeps the kernel's return-instance stack right.
                    sp = inj.regs[ptrace.REG["sp"]]
                    try:
                        ret_addr = ptrace.peekdata(tid, sp)
                    except OSError as exc:
                        if isinstance(exc, ProcessLookupError):
                            raise
                        error = f"cannot read the return address at sp {sp:#x}: {exc.strerror}"
                    else:
                        new = rewrite.skip(cur, inj, ret_addr)
            if new is not None:
                if inj.errno:
                    # Before the registers: an errno that cannot be set
                    # leaves the call to run as it would (not half a fault).
                    errno_addr, error = self._set_errno(tid, cur, inj.errno)
                    if error is not None:
                        new = None
                if new is not None:
                    ptrace.setregs(tid, new)
                    ip_after = new[REG_IP]
        except ProcessLookupError:
            self._emit(
                Outcome(
                    tid,
                    inj.fault_seq,
                    inj.action,
                    now,
                    0,
                    ip_before,
                    ip_after,
                    ret_addr,
                    "thread exited at the stop",
                )
            )
            return
        except OSError as exc:
            error = f"ptrace: {exc.strerror}"
        resumed = self._resume(tid, 0)  # suppress the signal either way
        self._emit(
            Outcome(
                tid,
                inj.fault_seq,
                inj.action,
                now,
                time.monotonic_ns() if resumed else 0,
                ip_before,
                ip_after,
                ret_addr,
                error if resumed else error or "thread exited at the stop",
                inj.errno if errno_addr and error is None else 0,
                errno_addr,
            )
        )

    def _set_errno(self, tid: int, cur: tuple[int, ...], value: int) -> tuple[int, str | None]:
        """Store value in the stopped thread's errno: (address, error)."""
        try:
            if self._errno_tpoff is None:
                self._errno_tpoff = errno_tls.tls_offset(self.pid)
        except errno_tls.ErrnoError as exc:
            return 0, f"errno not set: {exc}"
        addr = (cur[REG_FS_BASE] + self._errno_tpoff) & rewrite.MASK64
        try:
            try:
                if self._mem_fd is None:
                    self._mem_fd = errno_tls.open_mem(self.pid)
                errno_tls.write_errno(self._mem_fd, addr, value)
            except OSError as exc:
                if isinstance(exc, ProcessLookupError):
                    raise
                # The leader's view is gone (it called pthread_exit): the
                # thread's own.
                self._close_mem()
                fd = errno_tls.open_mem(tid)
                try:
                    errno_tls.write_errno(fd, addr, value)
                finally:
                    os.close(fd)
        except OSError as exc:
            if isinstance(exc, ProcessLookupError):
                raise
            return addr, f"errno not set: write at {addr:#x}: {exc.strerror or exc}"
        return addr, None

    def _close_mem(self) -> None:
        if self._mem_fd is not None:
            os.close(self._mem_fd)
            self._mem_fd = None

    def _stall(self, tid: int, inj: Injection, now: int) -> None:
        ip = 0
        try:
            ip = ptrace.getregs(tid)[REG_IP]
        except OSError:
            pass  # only evidence; the exit (if that is it) is reaped next
        ends = [t for t in (now + inj.stall_ns if inj.stall_ns else 0, inj.deadline_ns) if t]
        self._stalls[tid] = _Stall(inj, now, min(ends) if ends else None, ip)
        self._sync_watchdog()
        if self._stopping:
            self._end_stall(tid, "copilot stopping")
        self._publish()

    def _expire_stalls(self) -> None:
        now = time.monotonic_ns()
        for tid, st in list(self._stalls.items()):
            if st.until_ns is not None and st.until_ns <= now:
                self._end_stall(tid, None)

    def _end_stall(self, tid: int, error: str | None) -> None:
        st = self._stalls.pop(tid)
        resumed = self._resume(tid, 0)
        self._sync_watchdog()  # after the resume: disarming first could strand it
        self._emit(
            Outcome(
                tid,
                st.inj.fault_seq,
                st.inj.action,
                st.stop_ns,
                time.monotonic_ns() if resumed else 0,
                st.ip,
                st.ip,
                0,
                error if resumed else "thread exited during stall",
            )
        )
        self._publish()

    def _drop_stall(self, tid: int, error: str) -> None:
        st = self._stalls.pop(tid)
        self._sync_watchdog()
        self._emit(
            Outcome(tid, st.inj.fault_seq, st.inj.action, st.stop_ns, 0, st.ip, st.ip, 0, error)
        )
        self._publish()

    def _gone(self, tid: int, why: str) -> None:
        self._threads.discard(tid)
        if tid in self._stalls:
            self._drop_stall(tid, f"thread {why} during stall")
        # Drop an entry the thread never reached its stop for, so that a
        # later thread reusing the tid cannot inherit stale registers.
        try:
            inj = self._fetch(tid)
        except Exception:
            log.exception("copilot: fetch(%d) failed", tid)
            return
        if inj is not None:
            self._emit(
                Outcome(
                    tid, inj.fault_seq, inj.action, 0, 0, 0, 0, 0, f"thread {why} before its stop"
                )
            )

    def _resume(self, tid: int, sig: int) -> bool:
        """Continue (or detach, when stopping) a stopped thread; False if gone."""
        try:
            if self._stopping:
                ptrace.detach(tid, sig)
                self._threads.discard(tid)
            else:
                ptrace.cont(tid, sig)
        except ProcessLookupError:
            return False  # killed meanwhile; its exit is reaped next
        return True

    def _try(self, fn: Callable[[int], int | None], tid: int) -> int | None:
        try:
            return fn(tid)
        except ProcessLookupError:
            return None

    # ---- commands from other threads ----

    def _command(self, name: str, arg: int | None) -> int:
        thread = self._thread
        if thread is None or not thread.is_alive():
            return 0
        if threading.get_native_id() == self._tracer_tid:
            return self._exec(_Cmd(name, arg))
        cmd = _Cmd(name, arg)
        self._cmds.put(cmd)
        try:
            signal.pthread_kill(thread.ident or 0, signal.SIGCHLD)
        except ProcessLookupError:
            return 0
        while not cmd.done.wait(0.5):
            if not thread.is_alive():
                return 0
        return cmd.result

    def _run_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            cmd.result = self._exec(cmd)
            cmd.done.set()

    def _exec(self, cmd: _Cmd) -> int:
        if cmd.name == "release":
            tids = [t for t in self._stalls if cmd.arg is None or t == cmd.arg]
            for tid in tids:
                self._end_stall(tid, None)
            return len(tids)
        if cmd.name == "stop":
            self._begin_stop()
        return 0

    def _begin_stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._stop_deadline = time.monotonic_ns() + STOP_GRACE_NS
        for tid in list(self._stalls):
            self._end_stall(tid, "ended by stop()")
        # Detaching needs a stopped tracee: interrupt the running ones; each
        # is detached at whatever stop it reports next.
        for tid in list(self._threads):
            try:
                ptrace.interrupt(tid)
            except OSError as exc:
                if exc.errno != errno.ESRCH:
                    raise

    def _emit(self, outcome: Outcome) -> None:
        if self._on_outcome is None:
            return
        try:
            self._on_outcome(outcome)
        except Exception:
            log.exception("copilot: on_outcome failed")

    def _publish(self) -> None:
        with self._cv:
            self._stalled_view = sorted(self._stalls)
            self._cv.notify_all()


def check_not_traced(pid: int) -> None:
    """CopilotError when any thread of pid already has a tracer (gdb, strace):
    a thread has one tracer at most, so the copilot could not seize it."""
    try:
        tids = procfs.tids(pid) or [pid]
    except OSError:
        return  # gone: the caller's other checks say so
    for tid in tids:
        try:
            tracer = procfs.tracer_pid(pid, tid)
        except OSError:
            continue  # thread exited while we looked
        if tracer:
            raise CopilotError(
                f"pid {pid} is already traced by pid {tracer} ({_comm(tracer)}): "
                "detach that debugger/tracer (gdb, strace) first"
            )


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"
