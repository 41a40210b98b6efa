"""Run an engine against a target: a running pid, or a command we start.

With `-- CMD` the child is forked and held before exec (blocked on a pipe)
until every probe is attached and the copilot has seized it, so the fault
is armed before the first instruction of the program runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyctl import outchan, procstate
from pyctl.engine import Engine, EngineError, StoreWriteError
from pyctl.lazymod import OnFirstUse
from pyctl.run_options import RunOptions
from pyctl.sigmask import original_sigmask
from pyctl.spec import FaultSpec

if TYPE_CHECKING:
    import sqlite3
    import subprocess
else:
    sqlite3 = OnFirstUse("sqlite3")  # not before an early trace's probes are in


@dataclass
class Target:
    pid: int | None = None
    tid: int | None = None
    cmd: Sequence[str] = ()


def tgid_of(tid: int) -> int:
    try:
        for line in Path(f"/proc/{tid}/status").read_text().splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    except FileNotFoundError:
        pass
    raise EngineError(f"no thread {tid}: check the tid (is it still running?)")


# The init PID namespace's inode number is fixed (PROC_PID_INIT_INO).
PROC_PID_INIT_INO = 0xEFFFFFFC
PF_KTHREAD = 0x00200000


def _in_host_pid_namespace() -> bool:
    try:
        return os.stat("/proc/self/ns/pid").st_ino == PROC_PID_INIT_INO
    except OSError:
        return True  # cannot tell: let the kernel decide


def check_pid_namespace() -> None:
    """BPF compares the host's pids: from a nested PID namespace (a
    container without --pid=host) the pid we know never matches."""
    if not _in_host_pid_namespace():
        raise EngineError(
            "gpufault runs in a PID namespace other than the host's, and BPF sees host pids, "
            "so no fault could fire: run it on the host or in the host's PID namespace "
            "(docker/podman --pid=host, kubectl hostPID: true)"
        )


def check_target_pid(pid: int, what: str = "--pid") -> None:
    """Refuse a target where faults cannot fire or must not: no such
    process, a kernel thread, or PID 1 (init: a fault takes the system or
    the container down with it)."""
    if pid <= 0:
        raise EngineError(f"{what}: {pid} is not a process id: give the pid of a running process")
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        raise EngineError(f"no process {pid}: check the pid (is it still running?)") from None
    comm = stat[stat.find("(") + 1 : stat.rfind(")")]
    fields = stat[stat.rfind(")") + 2 :].split()
    flags = int(fields[6]) if len(fields) > 6 else 0
    if flags & PF_KTHREAD:
        raise EngineError(
            f"pid {pid} ({comm}) is a kernel thread: it runs no user-space code to probe: "
            "give the pid of a user process"
        )
    if pid == 1:
        raise EngineError(
            f"pid 1 ({comm}) is init: a fault there takes the whole system (or container) "
            "down: give the pid of the process that calls the library"
        )
    # The leader's state alone is not the process's: main may have called
    # pthread_exit while other threads run (procstate says why).
    if not procstate.alive(pid):
        ppid = fields[1] if len(fields) > 1 else "?"
        raise EngineError(
            f"pid {pid} ({comm}) has exited (a zombie its parent, pid {ppid}, has not reaped): "
            "no code runs there to probe: give the pid of a running process"
        )


def check_command(cmd: Sequence[str]) -> str:
    """The program `-- CMD` names, as the held shell's exec will find it;
    refused before anything starts (no run row for a command never run)."""
    prog = cmd[0] if cmd else ""
    if not prog:
        raise EngineError("no command after --: give one, e.g. -- ./app ARGS")
    if "/" in prog:
        if not os.path.exists(prog):
            raise EngineError(f"cannot run {prog}: no such file: check the path")
        if os.path.isdir(prog) or not os.access(prog, os.X_OK):
            raise EngineError(
                f"cannot run {prog}: not an executable file: chmod +x it or fix the path"
            )
        return prog
    found = shutil.which(prog)
    if found is None:
        raise EngineError(f"cannot run {prog!r}: command not found on PATH: give its path")
    return found


def _held_command(cmd: Sequence[str], fd: int) -> list[str]:
    """A shell that waits for one byte on fd, then execs cmd in place (same
    pid), so probes and the copilot are in place before cmd's first insn.
    The pipe is opened by path: dash takes only one-digit descriptors in
    `<&N`, and a run whose BPF object was loaded first (pyctl/entry.py)
    has its pipe above 9; /proc/self/fd, not /dev/fd, which only udev
    makes (a bare VM has none). A read that fails (no pipe, or gpufault
    gone before its "go") ends the shell with 125 and never starts cmd:
    it would run without its probes."""
    hold = f'read -r _ < /proc/self/fd/{fd} || exit 125; exec "$@"'
    return ["/bin/sh", "-c", hold, "gpufault-hold", *cmd]


def _start_with_original_mask(argv: list[str], fd: int) -> subprocess.Popen[bytes]:
    """Popen with the signal mask gpufault was started with: the controller
    blocks SIGCHLD for its copilot, and a mask survives fork and exec, so
    the command would otherwise run with SIGCHLD blocked (its own SIGCHLD
    handler never ran). fork() copies the calling thread's mask, so the
    mask is set around the Popen (no copilot runs yet to miss a SIGCHLD).
    Dispositions need nothing: handlers reset at exec, and Python's
    restore_signals puts back SIGPIPE/SIGXFSZ."""
    import subprocess  # lazy: for `-- CMD` only: a --pid start imports none of it (~6 ms)

    old = signal.pthread_sigmask(signal.SIG_SETMASK, original_sigmask())
    try:
        return subprocess.Popen(argv, pass_fds=(fd,))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):  # None (fd 2 closed at start), closed
        return False


def _status(text: str) -> None:
    """The status line, best effort: a failed write is not the run's."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass


def _rc_from_status(status: int) -> int:
    """Shell convention: exit code, or 128+N when signal N killed it."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _options(options: RunOptions | None, settings: dict[str, Any]) -> RunOptions:
    """RunOptions, or its fields by keyword (db_path=..., kind=...) for a
    caller without one; `status=False` is the old spelling of quiet=True."""
    if options is not None:
        if settings:
            raise TypeError(f"give RunOptions or keywords, not both: {', '.join(settings)}")
        return options
    if "status" in settings:
        settings["quiet"] = not settings.pop("status")
    return RunOptions(**settings)


# An engine whose probes the entry attached before the CLI was imported
# (pyctl/early.py), with the run it was started for.
_early: tuple[tuple[list[FaultSpec], RunOptions, int | None, int | None], Engine] | None = None


# SIGINT/SIGTERM from when the early probes go in until run() takes over:
# remembered (the handlers they replaced kept here), not raised. Raised,
# a Ctrl-C in the CLI's imports ended the process with the calls the ring
# already held never stored; remembered, run() starts the run and ends it
# at once, and they are stored (as a Ctrl-C right after the start-up line).
_held_handlers: dict[int, Any] = {}
_stop_held = False


def _remember_stop(_signo: int, _frame: Any) -> None:
    global _stop_held
    _stop_held = True


def hold_stop_signals() -> None:
    """From now until run(): Ctrl-C and SIGTERM end the run once it starts."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        if sig not in _held_handlers:
            _held_handlers[sig] = signal.signal(sig, _remember_stop)


def release_stop_signals() -> bool:
    """The handlers hold_stop_signals replaced, back; was a stop asked for?"""
    global _stop_held
    for sig, h in _held_handlers.items():
        signal.signal(sig, h)
    _held_handlers.clear()
    asked, _stop_held = _stop_held, False
    return asked


def offer_early(
    specs: list[FaultSpec], options: RunOptions, pid: int | None, tid: int | None, eng: Engine
) -> None:
    """Hold eng, started with store_later for this run, for the runner."""
    global _early
    _early = ((list(specs), options, pid, tid), eng)


def take_early(
    specs: list[FaultSpec], options: RunOptions, pid: int | None, tid: int | None
) -> Engine | None:
    """The early engine when it was started for this very run (equal specs,
    settings, pid and tid); else None, and an early one is closed: it
    wrote nothing, so nothing of it is left."""
    global _early
    held, _early = _early, None
    if held is None:
        return None
    run, eng = held
    if run == (list(specs), options, pid, tid):
        return eng
    eng.close(status="refused")
    return None


class Runner:
    def __init__(
        self,
        specs: list[FaultSpec],
        target: Target,
        options: RunOptions | None = None,
        *,
        echo: Callable[[str], None] | None = None,
        on_xid: Callable[[Any], None] | None = None,
        **settings: Any,
    ):
        self.options = opts = _options(options, settings)
        self.specs = specs
        self.max_db_bytes = opts.max_db_bytes
        self.target = target
        self.db_path = opts.db_path
        self.argv = opts.argv
        self.kind = opts.kind
        self.duration = opts.duration
        self.copilot_signal = opts.copilot_signal
        self.show_status = opts.status and _isatty(sys.stderr)
        # Best effort: a closed or broken stderr never ends the loop
        # (pyctl/outchan.py; the CLI also makes it non-blocking).
        self.echo = echo or outchan.echo
        self.child: subprocess.Popen[bytes] | None = None
        self._control: Any = None  # the ControlSocket `gpufault release` talks to
        self.engine: Engine | None = None
        self.xids: Any = None
        self.record_xids = opts.xids
        self.on_xid = on_xid
        self._stop = False

    def start(self) -> Engine:
        t = self.target
        pid = t.pid
        check_pid_namespace()
        if t.pid is not None:
            check_target_pid(t.pid)
        if t.tid is not None:
            if t.tid <= 0:
                raise EngineError(f"--tid: {t.tid} is not a thread id: give a running thread's id")
            pid = tgid_of(t.tid)
            if t.pid is not None and t.pid != pid:
                raise EngineError(f"thread {t.tid} belongs to pid {pid}, not {t.pid}")
            check_target_pid(pid, "--tid")
        if t.cmd:
            check_command(t.cmd)
        if t.cmd:
            # lazy: pyctl.symbols.resolve here only for `-- CMD`'s program dirs
            from pyctl.symbols import resolve

            resolve.add_search_dirs_for_program(t.cmd[0])
            r, w = os.pipe()
            try:
                self.child = _start_with_original_mask(_held_command(t.cmd, r), r)
            except OSError as e:
                os.close(r)
                os.close(w)
                raise EngineError(f"cannot start {t.cmd[0]}: {e.strerror}") from None
            os.close(r)
            eng = Engine(
                self.specs, options=self.options, pid=self.child.pid, resolve_in_target=False
            )
            try:
                eng.start()
            except BaseException:
                # Nothing ran yet: the held child dies without executing.
                self.child.kill()
                self.child.wait()
                os.close(w)
                raise
            os.write(w, b"go\n")
            os.close(w)
        else:
            # The probes may be in already (pyctl/early.py): then start()
            # opens the store and writes the run's rows.
            eng = take_early(self.specs, self.options, pid, t.tid) or Engine(
                self.specs, options=self.options, pid=pid, tid=t.tid
            )
            eng.start()
        self.engine = eng
        eng.on_notice = self.echo
        self._start_xids()
        self._write_pidfile()
        return eng

    def _start_xids(self) -> None:
        """Record NVIDIA Xids beside the engine where the driver's tracepoint
        exists (gpufault doctor says when it does not). The monitor writes
        through the engine's connection, on this thread (the one that
        started the engine and runs loop() and finish())."""
        if self.engine is None or not self.record_xids:
            return
        try:
            # lazy: the Xid monitor (its BPF object, ringbuf) only when Xids are recorded
            from pyctl.xid import XidError, XidMonitor

            mon = XidMonitor.beside(self.engine)
            mon.start()
        except (ImportError, XidError, OSError):
            return
        pid = getattr(self.engine, "pid", None)
        if pid:
            mon.note_pid(pid)  # while it is alive: a fault may kill it
        self.xids = mon

    def _close_xids(self) -> None:
        """Read the last Xids and stop recording them: before the engine's
        run row is ended (and its connection closed), after the engine's own
        records are in, so a last Xid still finds its fault."""
        mon = self.xids
        if mon is None:
            return
        self.xids = None
        eng = self.engine
        try:
            if eng is not None and eng.obj is not None and eng.db is not None:
                eng.drain()
        finally:
            mon.close()

    def note_fire(self, row: dict[str, Any]) -> None:
        if self.xids is not None:
            self.xids.note_fault(row)

    def _write_pidfile(self) -> None:
        """Open the control socket `gpufault release` talks to (pyctl/control.py)."""
        # lazy: keeps pyctl.control (selectors, socket, +6 modules) off trace's start
        from pyctl.control import ControlSocket

        ctl = ControlSocket(self.engine.run_id if self.engine else "")
        try:
            ctl.start()
        except OSError as e:
            self.echo(f"warning: no control socket ({e.strerror}): `gpufault release` "
                      "cannot reach this run; SIGUSR1 to this process still releases")
            return
        self._control = ctl

    def _remove_pidfile(self) -> None:
        ctl, self._control = self._control, None
        if ctl is not None:
            ctl.close()

    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def release_stalls(self, *_: Any) -> None:
        eng = self.engine
        if eng is not None and eng.copilot is not None:
            n = eng.copilot.release(None)
            self.echo(f"released {n} stalled thread(s)")

    def loop(self, handle_signals: bool = True) -> int:
        """Consume until Ctrl-C, --duration, request_stop() or the command's
        exit. handle_signals=False: install no handler (the library's
        sessions run this loop on a thread of their own, where Python
        refuses signal.signal, and a host program keeps its own handlers)."""
        eng = self.engine
        assert eng is not None
        if handle_signals:
            old_int = signal.signal(signal.SIGINT, self.request_stop)
            old_term = signal.signal(signal.SIGTERM, self.request_stop)
            old_usr1 = signal.signal(signal.SIGUSR1, self.release_stalls)
        t0 = time.monotonic()
        # --duration counts from the arm, as the kernel's deadlines do: a
        # trace attached early (pyctl/early.py) was armed well before this.
        t_end = (eng.armed_at_s() or t0) + self.duration
        last = 0.0
        last_maps = 0.0
        rc = 0
        try:
            # Each pass is bounded (poll waits <= 50 ms, the drain stops after
            # ~50 ms plus one batch), so the deadline, Ctrl-C/SIGTERM and the
            # target's exit are seen within ~100 ms at any event rate.
            while not self._stop:
                eng.poll(0.05)
                if self.xids is not None:
                    try:
                        xs = self.xids.poll(0)
                    except sqlite3.Error as e:  # its rows go through our store
                        eng.fail_writes(e)
                    for x in xs:
                        if self.on_xid is not None:
                            self.on_xid(x)
                now = time.monotonic()
                # Often at first (a started command is still loading its
                # libraries), then every 2 s.
                if now - last_maps >= (0.05 if now - t0 < 2 else 2.0):
                    last_maps = now
                    eng.refresh_maps()
                if self.duration and now >= t_end:
                    break
                if self.child is not None and self._child_exited():
                    break
                # Exited: gone, or a zombie not yet reaped (no live thread).
                if self.target.pid and not procstate.alive(self.target.pid):
                    self.echo(f"pid {self.target.pid} exited")
                    break
                if self.show_status and now - last >= 1.0:
                    last = now
                    # Records lost, as the end-of-run line counts them (the
                    # other stats are errors of another kind, not records).
                    st = eng.lost()
                    lost = st["events_lost"] + st["fires_lost"]
                    _status(
                        f"\r{now - t0:6.1f}s  events {eng.stats.events}  fires {eng.stats.fires}"
                        f"  lost {lost}   "
                    )
        finally:
            if handle_signals:
                signal.signal(signal.SIGINT, old_int)
                signal.signal(signal.SIGTERM, old_term)
                signal.signal(signal.SIGUSR1, old_usr1)
            if self.show_status:
                _status("\n")
        if self.child is not None:
            # Ctrl-C ends our watch, not the command: _child_rc detaches, then waits.
            rc = self._child_rc()
        return rc

    def _traced(self) -> bool:
        eng = self.engine
        return eng is not None and eng.copilot is not None

    def _child_exited(self) -> bool:
        """Has the command ended? While the copilot traces our own child, its
        tracer thread reaps it (waitpid here would steal ptrace stops)."""
        assert self.child is not None
        if self._traced():
            return not self.engine.copilot.running  # type: ignore[union-attr]
        return self.child.poll() is not None

    def _child_rc(self) -> int:
        assert self.child is not None
        eng = self.engine
        status = None
        if self._traced():
            cop = eng.copilot  # type: ignore[union-attr]
            if not cop.running:
                status = cop.exit_status
            else:
                self._close_xids()
                eng.close(status="detached")  # type: ignore[union-attr]
        if status is not None:
            return _rc_from_status(status)
        if eng is not None and self.child.poll() is None:
            self._close_xids()
            eng.close(status="detached")
        try:
            code = self.child.wait()
        except ChildProcessError:
            return 0
        return 128 - code if code < 0 else code

    def finish(self, status: str = "done", exit_code: int | None = None) -> None:
        """Xids first (written into the run), then the engine ends the run."""
        try:
            self._close_xids()
        finally:
            if self.engine is not None:
                self.engine.close(status=status, exit_code=exit_code)
            self._remove_pidfile()


def run(
    specs: list[FaultSpec],
    target: Target,
    options: RunOptions | None = None,
    *,
    on_start: Callable[[Engine], None] | None = None,
    on_fire: Callable[[dict[str, Any]], None] | None = None,
    on_xid: Callable[[Any], None] | None = None,
    **settings: Any,
) -> tuple[int, Engine]:
    """Start, loop, finish: one run of `specs` against `target` with the
    run's settings (`options`, or RunOptions' fields by keyword)."""
    r = Runner(specs, target, _options(options, settings), on_xid=on_xid)
    stop_asked = release_stop_signals()
    # Ctrl-C and SIGTERM end the run cleanly from before it starts until it
    # is closed: on_start prints "Ctrl-C to end" before loop() runs, and a
    # signal there must not skip finish() (the run row would stay
    # "running"). loop() sees the flag at once.
    old_handlers = {
        sig: signal.signal(sig, r.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    if stop_asked:  # while the early probes waited for the CLI (hold_stop_signals)
        r.request_stop()
    try:
        eng = r.start()

        def fired(row: dict[str, Any]) -> None:
            r.note_fire(row)
            if on_fire is not None:
                on_fire(row)

        eng.on_fire = fired
        rc = 0
        end = "done"
        try:
            if on_start:
                on_start(eng)
            rc = r.loop()
        except StoreWriteError:
            end = "failed"
            raise
        finally:
            r.finish(status=end, exit_code=rc if target.cmd else None)
            if end == "failed" or eng.write_error is not None:  # also: failed at close
                # Faults were disarmed at the failed write and are detached now.
                # stats count committed batches only: this is what the file holds.
                kept = eng.stats.events - eng.stats.dropped
                marked = (
                    f"run {eng.run_id} marked failed"
                    if eng.end_error is None
                    else f"run {eng.run_id} could not be marked failed ({eng.end_error})"
                )
                raise StoreWriteError(
                    f"{eng.write_error}: every fault stopped and detached; {marked}; "
                    f"what was written before is kept ({eng.stats.fires} faults, "
                    f"{kept} call rows)"
                )
    finally:
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
    return rc, eng
