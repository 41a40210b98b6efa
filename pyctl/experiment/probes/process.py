"""Process probes: a command's exit status and stdout (command), and a
process by pid, pidfile, name or the experiment's own target (process)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
from typing import Any, ClassVar

from pyctl.experiment.facts import render_facts, stand_ins
from pyctl.experiment.probes.base import Value, _Probe, _Table, _verdict
from pyctl.experiment.probes.tolerance import ProbeError


class CommandProbe(_Probe):
    """A command's exit status (default 0) and, optionally, its stdout
    (stripped) against `tolerance`. Killed with its process group at timeout."""

    kind = "command"
    FACT_FIELDS = ("argv", "cwd", "env")

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        cmd = r.get("command", (str, list), '"curl -sf http://127.0.0.1:8000/health"', facts=True)
        self.shell = r.get("shell", (bool,), "true", False)
        if isinstance(cmd, list):
            if not cmd or not all(isinstance(c, str) for c in cmd):
                raise ProbeError(f'{r.where}.command: a list must hold strings (e.g. ["true"])')
            if self.shell:
                raise ProbeError(f"{r.where}.command: with shell = true, write one string")
            self.argv: list[str] | str = list(cmd)
        elif self.shell:
            self.argv = cmd
        else:
            try:
                self.argv = shlex.split(cmd)
            except ValueError as e:
                raise ProbeError(f"{r.where}.command: {cmd!r}: {e} (fix the quoting)") from None
        if not self.argv:
            raise ProbeError(f"{r.where}.command: empty command")
        self.cwd = r.get("cwd", (str,), '"/tmp"', None, facts=True)
        self.env = r.strings("env", '{LC_ALL = "C"}', facts=True)
        if not self.shell:
            prog = str(render_facts(self.argv[0], stand_ins(self.argv[0])))
            found = os.access(prog, os.X_OK) if "/" in prog else shutil.which(prog)
            if not found:
                raise ProbeError(
                    f"{r.where}.command: {prog!r} is not an executable on PATH"
                    f" ({os.environ.get('PATH', '')}): give its full path or install it"
                )
        self.exit_status = r.tolerance("exit_status", 0)
        self.tolerance = r.optional_tolerance("tolerance")

    def with_facts(self, facts: dict[str, Any]) -> Any:
        p = super().with_facts(facts)
        if isinstance(p.argv, list):  # a fact alone ("{pid}") is a word of text
            p.argv = [str(w) for w in p.argv]
        return p

    def _measure(self) -> tuple[bool, Value, str]:
        env = {**os.environ, **self.env} if self.env else None
        p = subprocess.Popen(
            self.argv,
            shell=self.shell,
            cwd=self.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = p.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            # Its own session: the group kill takes a shell's children too.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()
            return False, None, f"command {self.name}: timeout after {self.timeout:g}s (killed)"
        rc = p.returncode
        st_ok = self.exit_status.check(rc)
        what = f"exit {rc}" + ("" if st_ok else f" (want {self.exit_status})")
        if not st_ok and err.strip():
            what += f", stderr {err.decode(errors='replace').strip()[-120:]!r}"
        if self.tolerance is None:
            return st_ok, rc, f"command {self.name}: {what}"
        text = out.decode(errors="replace").strip()
        ok = self.tolerance.check(text)
        return (
            st_ok and ok,
            text,
            f"command {self.name}: {what}, stdout {text[:60]!r} ({_verdict(ok, self.tolerance)})",
        )


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a pid, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = raw[raw.rindex(")") + 2 :].split()  # comm may hold spaces and parens
    return rest[0], int(rest[19])


def _alive(ident: tuple[int, int] | None) -> bool:
    if ident is None:
        return False
    st = _stat(ident[0])
    return st is not None and st[0] not in ("Z", "X") and st[1] == ident[1]


class ProcessProbe(_Probe):
    """A process by pid, pidfile, name (/proc/PID/comm) or the experiment's
    target (target = true: the runner calls bind()). check = "alive"
    (default tolerance true), "restarts" (pid changes seen between samples
    since the first one, default "== 0"; a pidfile or a name), or
    "exit_status" (the target only: gpufault can read the status only of a
    process it started; a signal is -N as in subprocess)."""

    kind = "process"
    FACT_FIELDS = ("pid", "pidfile", "proc_name")
    CHECKS: ClassVar[dict[str, object]] = {"alive": True, "restarts": "== 0", "exit_status": 0}

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        # pid = "{rank1_pid}" is an int once the fact is in.
        self.pid: Any = r.get("pid", (int,), "1234", None, facts=True)
        self.pidfile = r.get("pidfile", (str,), '"/run/svc.pid"', None, facts=True)
        self.proc_name = r.get("name", (str,), '"gf-worker"', None, facts=True)
        self.target = r.get("target", (bool,), "true", False)
        given = [
            k
            for k, v in (
                ("pid", self.pid),
                ("pidfile", self.pidfile),
                ("name", self.proc_name),
                ("target", self.target or None),
            )
            if v is not None
        ]
        if len(given) != 1:
            raise ProbeError(
                f"{r.where}: give exactly one of pid, pidfile, name, target = true"
                f" (got {', '.join(given) or 'none'})"
            )
        self.check = r.choice("check", tuple(self.CHECKS), "alive")
        if self.check == "restarts" and self.pidfile is None and self.proc_name is None:
            raise ProbeError(
                f"{r.where}.check: restarts are counted by the pid of a pidfile or a name"
                " (a fixed pid cannot restart): give pidfile or name"
            )
        if self.check == "exit_status" and not self.target:
            raise ProbeError(
                f"{r.where}.check: exit_status needs target = true (the exit status of a"
                " process gpufault did not start cannot be read)"
            )
        self.tolerance = r.tolerance("tolerance", self.CHECKS[self.check])
        self._reset()

    def _reset(self) -> None:
        self._popen: subprocess.Popen[Any] | None = None
        self._ident: tuple[int, int] | None = None  # (pid, start time) watched / last seen
        self.restarts = 0
        if isinstance(self.pid, int) and not self.target:
            self.bind(self.pid)

    def bind(self, pid: int, popen: subprocess.Popen[Any] | None = None) -> None:
        """The experiment's target (target = true): its pid, and its Popen
        when gpufault started it (for exit_status). The start time read now
        tells the process from a later one that reuses its pid."""
        self.pid, self._popen = pid, popen
        st = _stat(pid)
        self._ident = (pid, st[1] if st else -1)

    def _current(self) -> tuple[int, int] | None:
        """Who runs now: (pid, start time), None if no one."""
        if self.pidfile is not None:
            try:
                with open(self.pidfile) as f:
                    pid = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                return None
            st = _stat(pid)
            return (pid, st[1]) if st and st[0] not in ("Z", "X") else None
        if self.proc_name is not None:
            best = None
            for d in os.listdir("/proc"):
                if not d.isdigit():
                    continue
                try:
                    with open(f"/proc/{d}/comm") as f:
                        if f.read().rstrip("\n") != self.proc_name:
                            continue
                except OSError:
                    continue
                st = _stat(int(d))
                if st and st[0] not in ("Z", "X") and (best is None or st[1] < best[1]):
                    best = (int(d), st[1])  # the oldest of that name
            return best
        if self._popen is not None and self._popen.poll() is not None:
            return None  # reaped: its pid may be someone else's by now
        return self._ident if _alive(self._ident) else None

    def _measure(self) -> tuple[bool, Value, str]:
        who = self._who()
        if self._ident is None and self.pidfile is None and self.proc_name is None:
            return False, None, f"process {who}: target not bound yet (runner: call bind())"
        if self.check == "exit_status":
            if self._popen is None:
                return False, None, f"process {who}: exit status unknown (not started by gpufault)"
            rc = self._popen.poll()
            if rc is None:
                return False, None, f"process {who}: still running"
            ok = self.tolerance.check(rc)
            return ok, rc, f"process {who}: exited {rc} ({_verdict(ok, self.tolerance)})"
        cur = self._current()
        if self.check == "restarts":
            if cur is not None:
                if self._ident is not None and cur != self._ident:
                    self.restarts += 1
                self._ident = cur
            ok = self.tolerance.check(self.restarts)
            now = f"pid {cur[0]} running" if cur else "none running"
            return (
                ok,
                self.restarts,
                f"process {who}: {self.restarts} restarts, {now} ({_verdict(ok, self.tolerance)})",
            )
        alive = cur is not None
        ok = self.tolerance.check(alive)
        state = f"pid {cur[0]} alive" if cur else "not running"
        return ok, alive, f"process {who}: {state} ({_verdict(ok, self.tolerance)})"

    def _who(self) -> str:
        if self.pidfile is not None:
            return f"{self.name} (pidfile {self.pidfile})"
        if self.proc_name is not None:
            return f"{self.name} (name {self.proc_name})"
        return f"{self.name} (pid {self.pid})"
