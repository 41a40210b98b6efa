"""Run an engine against a target: a running pid, or a command we start.

With `-- CMD` the child is forked and held before exec (blocked on a pipe)
until every probe is attached and the copilot has seized it, so the fault
is armed before the first instruction of the program runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyctl import store
from pyctl.engine import Engine, EngineError
from pyctl.spec import FaultSpec

RUN_DIR = Path("/run/gpufault")


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


def _held_command(cmd: Sequence[str], fd: int) -> list[str]:
    """A shell that waits for one byte on fd, then execs cmd in place (same
    pid), so probes and the copilot are in place before cmd's first insn."""
    return ["/bin/sh", "-c", f'read -r _ <&{fd}; exec "$@"', "gpufault-hold", *cmd]


def _rc_from_status(status: int) -> int:
    """Shell convention: exit code, or 128+N when signal N killed it."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class Runner:
    def __init__(
        self,
        specs: list[FaultSpec],
        target: Target,
        *,
        db_path: str | os.PathLike[str],
        argv: Sequence[str],
        kind: str,
        duration: float = 0.0,
        copilot_signal: int | None = None,
        status: bool = True,
        echo: Callable[[str], None] | None = None,
        xids: bool = True,
        on_xid: Callable[[Any], None] | None = None,
    ):
        self.specs = specs
        self.target = target
        self.db_path = db_path
        self.argv = argv
        self.kind = kind
        self.duration = duration
        self.copilot_signal = copilot_signal
        self.show_status = status and sys.stderr.isatty()
        self.echo = echo or (lambda s: print(s, file=sys.stderr))
        self.child: subprocess.Popen[bytes] | None = None
        self.engine: Engine | None = None
        self.xids: Any = None
        self.record_xids = xids
        self.on_xid = on_xid
        self._stop = False

    def _prepare_specs(self, pid: int | None, tid: int | None) -> None:
        for s in self.specs:
            s.tgid = pid or 0
            s.tid = tid or 0
            if self.duration and not s.duration_s:
                s.duration_s = self.duration

    def start(self) -> Engine:
        t = self.target
        pid = t.pid
        if t.tid is not None:
            pid = tgid_of(t.tid)
            if t.pid is not None and t.pid != pid:
                raise EngineError(f"thread {t.tid} belongs to pid {pid}, not {t.pid}")
        kw: dict[str, Any] = {}
        if self.copilot_signal:
            kw["copilot_signal"] = self.copilot_signal
        if t.cmd:
            from pyctl import resolve

            resolve.add_search_dirs_for_program(t.cmd[0])
            r, w = os.pipe()
            try:
                self.child = subprocess.Popen(_held_command(t.cmd, r), pass_fds=(r,))
            except OSError as e:
                os.close(r)
                os.close(w)
                raise EngineError(f"cannot start {t.cmd[0]}: {e.strerror}") from None
            os.close(r)
            self._prepare_specs(self.child.pid, None)
            eng = Engine(
                self.specs,
                db_path=self.db_path,
                pid=self.child.pid,
                argv=self.argv,
                kind=self.kind,
                resolve_in_target=False,
                **kw,
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
            self._prepare_specs(pid, t.tid)
            eng = Engine(
                self.specs, db_path=self.db_path, pid=pid, argv=self.argv, kind=self.kind, **kw
            )
            eng.start()
        self.engine = eng
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
            from pyctl.xid import XidError, XidMonitor

            mon = XidMonitor.beside(self.engine)
            mon.start()
        except (ImportError, XidError, OSError):
            return
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
        try:
            RUN_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
            (RUN_DIR / f"{os.getpid()}.run").write_text(self.engine.run_id if self.engine else "")
        except OSError:
            pass

    def _remove_pidfile(self) -> None:
        try:
            (RUN_DIR / f"{os.getpid()}.run").unlink()
        except OSError:
            pass

    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def release_stalls(self, *_: Any) -> None:
        eng = self.engine
        if eng is not None and eng.copilot is not None:
            n = eng.copilot.release(None)
            self.echo(f"released {n} stalled thread(s)")

    def loop(self) -> int:
        """Consume until Ctrl-C, --duration, or the command's exit."""
        eng = self.engine
        assert eng is not None
        old_int = signal.signal(signal.SIGINT, self.request_stop)
        old_term = signal.signal(signal.SIGTERM, self.request_stop)
        old_usr1 = signal.signal(signal.SIGUSR1, self.release_stalls)
        t0 = time.monotonic()
        last = 0.0
        last_maps = 0.0
        rc = 0
        try:
            while not self._stop:
                eng.poll(0.05)
                if self.xids is not None:
                    for x in self.xids.poll(0):
                        if self.on_xid is not None:
                            self.on_xid(x)
                now = time.monotonic()
                # Often at first (a started command is still loading its
                # libraries), then every 2 s.
                if now - last_maps >= (0.05 if now - t0 < 2 else 2.0):
                    last_maps = now
                    eng.refresh_maps()
                if self.duration and now - t0 >= self.duration:
                    break
                if self.child is not None and self._child_exited():
                    break
                if self.target.pid and not os.path.exists(f"/proc/{self.target.pid}"):
                    self.echo(f"pid {self.target.pid} exited")
                    break
                if self.show_status and now - last >= 1.0:
                    last = now
                    lost = sum(eng.lost().values())
                    sys.stderr.write(
                        f"\r{now - t0:6.1f}s  events {eng.stats.events}  fires {eng.stats.fires}"
                        f"  lost {lost}   "
                    )
                    sys.stderr.flush()
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
            signal.signal(signal.SIGUSR1, old_usr1)
            if self.show_status:
                sys.stderr.write("\n")
        if self.child is not None:
            if self.child.poll() is None and self._stop:
                # Ctrl-C ends our watch, not the command: detach, then wait.
                pass
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
    *,
    db_path: str | os.PathLike[str] = store.DEFAULT_DB,
    argv: Sequence[str] = (),
    kind: str = "inject",
    duration: float = 0.0,
    copilot_signal: int | None = None,
    on_start: Callable[[Engine], None] | None = None,
    on_fire: Callable[[dict[str, Any]], None] | None = None,
    status: bool = True,
    xids: bool = True,
    on_xid: Callable[[Any], None] | None = None,
) -> tuple[int, Engine]:
    r = Runner(
        specs,
        target,
        db_path=db_path,
        argv=argv,
        kind=kind,
        duration=duration,
        copilot_signal=copilot_signal,
        status=status,
        xids=xids,
        on_xid=on_xid,
    )
    eng = r.start()

    def fired(row: dict[str, Any]) -> None:
        r.note_fire(row)
        if on_fire is not None:
            on_fire(row)

    eng.on_fire = fired
    if on_start:
        on_start(eng)
    rc = 0
    try:
        rc = r.loop()
    finally:
        r.finish(status="done", exit_code=rc if target.cmd else None)
    return rc, eng
