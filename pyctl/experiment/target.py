"""The target: the process faults go into and the service the load and
probes talk to. Read from [target] (a url and a pid, or a command gpufault
starts and waits for: its ready line on stderr, or its ready file), checked
before anything is armed (the URL answers TCP, the process runs), stopped
at the end; a target given by pid is watched through a pidfd.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pyctl.experiment.children import child_argv, child_env
from pyctl.experiment.model import (
    ADMIN_TOKEN_ENV,
    GPUFAULT,
    SERVICE_READY,
    Experiment,
    ExperimentError,
    Step,
    Target,
)
from pyctl.experiment.reader import Reader

# What a target may need of the host ([target] requires): an experiment
# that needs what the host lacks is skipped with one line, not started.
REQUIREMENTS = ("gpu",)


def host_has_gpu() -> bool:
    """An NVIDIA GPU the driver knows (its /proc entries; /dev/nvidiaN where
    /proc/driver is not mounted in, as in some containers)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    try:
        if any(gpus.iterdir()):
            return True
    except OSError:
        pass
    return any(re.fullmatch(r"nvidia\d+", n) for n in _dev_names())


def _dev_names() -> list[str]:
    try:
        return os.listdir("/dev")
    except OSError:
        return []


def missing_on_host(t: Target) -> str | None:
    """What the target needs that this host lacks, as the one line a
    skipped experiment prints; None when nothing is missing."""
    if t.needs_gpu and not host_has_gpu():
        why = f"its service runs on {t.device}" if t.device else 'it requires ["gpu"]'
        return f"needs a GPU ({why}) and this host has none"
    return None


def parse_target(r: Reader, doc: dict[str, Any]) -> Target:
    t = r.table(
        doc,
        "target",
        {
            "url",
            "pid",
            "command",
            "ready",
            "service",
            "start_timeout",
            "env",
            "admin_token_env",
            "requires",
        },
        required=True,
    )
    url = r.str_(t, "target", "url", "") or None
    if url is not None and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", url):
        raise r.err("target.url", f"{url!r} is not an http URL: write e.g. http://127.0.0.1:8000")
    pid = None
    if "pid" in t:
        pid = r.int_(t, "target", "pid", lo=1)
    command: list[str] = []
    if "command" in t:
        command = r.command(t, "target", "command")
    env = r.env(t, "target", "env")
    admin_token_env = r.str_(t, "target", "admin_token_env", "") or None
    requires = t.get("requires", [])
    if not isinstance(requires, list) or not all(x in REQUIREMENTS for x in requires):
        raise r.err(
            "target.requires",
            f"expected a list of {' / '.join(repr(x) for x in REQUIREMENTS)} "
            '(requires = ["gpu"]: skipped with one line on a host without one)',
        )
    device = None
    if "service" in t:
        # The reference service is a command like any other: this shortcut
        # only spells its command line, ready line and admin token variable;
        # `gpufault service` itself checks its options when it starts.
        s = r.table(t, "target.service", {"device", "args", "env"})
        dev = r.str_(s, "target.service", "device", "cpu")
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", dev):
            raise r.err("target.service.device", f"{dev!r}: give a device such as cpu or cuda")
        args = s.get("args", [])
        if isinstance(args, list):
            # "{knob}" alone keeps the knob's type: a number is an option value too.
            args = [
                str(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a
                for a in args
            ]
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise r.err(
                "target.service.args",
                "expected a list of strings (the options of `gpufault service`)",
            )
        env.update(r.env(s, "target.service", "env"))
        command = [GPUFAULT, "service", "--port", "0", "--device", dev, *args]
        device = dev
        if dev.startswith("cuda"):
            requires = [*requires, "gpu"]
        if admin_token_env is None and "--perturb-control" in args:
            admin_token_env = ADMIN_TOKEN_ENV
    if admin_token_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", admin_token_env):
        raise r.err("target.admin_token_env", f"{admin_token_env!r} is not a variable name")
    given = [k for k in ("pid", "command", "service") if k in t]
    if len(given) > 1:
        raise r.err("target", f"{' and '.join(given)} both name the process: keep one")
    if not given:
        raise r.err("target", "no process to inject into: add pid, command or service")
    if (pid is not None) and url is None:
        raise r.err("target.url", "missing: a pid target needs the service's url")
    if pid is not None and (env or admin_token_env):
        raise r.err("target", "env and admin_token_env are for a command gpufault starts")
    ready = r.str_(t, "target", "ready", SERVICE_READY)
    try:
        re.compile(ready)
    except re.error as e:
        raise r.err("target.ready", f"not a regular expression ({e})") from None
    return Target(
        url=url,
        pid=pid,
        command=command,
        ready=ready,
        start_timeout=r.duration(t, "target", "start_timeout", "90s"),
        env=env,
        admin_token_env=admin_token_env,
        device=device,
        requires=tuple(dict.fromkeys(requires)),
    )


class TargetProcess:
    """A process gpufault starts (target.command or target.service): ready
    when its ready line appears on stderr (and its ready file, if it was
    given one); stopped with SIGTERM at the end; told to die with us."""

    def __init__(
        self,
        argv: list[str],
        ready: str,
        ready_file: Path | None,
        timeout: float,
        env: dict[str, str] | None = None,
    ) -> None:
        self.ready_re = re.compile(ready)
        self.ready_file = ready_file
        self.admin_token: str | None = None  # a service's /admin token, set by start_target
        self.lines: list[str] = []
        self.match: re.Match[str] | None = None
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            argv,
            env=child_env(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name="gf-exp-target", daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or self.match is None:
            tail = " | ".join(ln for ln in self.lines[-3:] if ln.strip())
            rc = self.proc.poll()
            self.stop()
            why = f"exited with status {rc}" if rc is not None else f"not ready in {timeout:g}s"
            raise ExperimentError(
                f"target: {argv[0]} {why} ({tail or 'no output'}): "
                "check target.command / target.service"
            )

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for ln in self.proc.stderr:
            self.lines.append(ln.rstrip("\n"))
            del self.lines[:-200]
            if self.match is None and (m := self.ready_re.search(ln)):
                self.match = m
                self._ready.set()
        self._ready.set()

    def facts(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pid": self.proc.pid}
        m = self.match
        if m is not None:
            gd = m.groupdict()
            if gd.get("url"):
                out["url"] = gd["url"]
            line = m.string
            if (p := re.search(r"\bpid (\d+)", line)) is not None:
                out["pid"] = int(p.group(1))
            if (t := re.search(r"\btid (\d+)", line)) is not None:
                out["worker_tid"] = int(t.group(1))
            # The service's --ranks N line: "... rank 1 pid P tid T".
            for r, rp, rt in re.findall(r"\brank (\d+) pid (\d+) tid (\d+)", line):
                out[f"rank{r}_pid"], out[f"rank{r}_tid"] = int(rp), int(rt)
        if self.ready_file is not None and self.ready_file.is_file():
            try:
                info = json.loads(self.ready_file.read_text())
            except (OSError, ValueError):
                info = {}
            out.update({k: info[k] for k in ("url", "pid", "worker_tid") if k in info})
            out.update(rank_facts(info))
        return out

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)
            try:
                self.ready_file.parent.rmdir()
            except OSError:
                pass
        return self.proc.returncode


def rank_facts(info: dict[str, Any]) -> dict[str, int]:
    """rankN_pid / rankN_tid from a ready file's `ranks` list (the service's
    --ranks N: [{"rank", "pid", "worker_tid", ...}, ...])."""
    out: dict[str, int] = {}
    ranks = info.get("ranks")
    for r in ranks if isinstance(ranks, list) else []:
        if not isinstance(r, dict) or not isinstance(r.get("rank"), int):
            continue
        for key, fact in (("pid", "pid"), ("worker_tid", "tid")):
            v = r.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out[f"rank{r['rank']}_{fact}"] = v
    return out


def start_target(exp: Experiment) -> tuple[TargetProcess | None, dict[str, Any]]:
    t = exp.target
    facts: dict[str, Any] = {"url": t.url, "pid": t.pid}
    proc = None
    if t.command:
        ready_file = None
        argv = list(t.command)
        if argv[0] == GPUFAULT:
            # This gpufault, isolated. No private ready file for it: its
            # directory would outlive a SIGKILLed runner; its ready line
            # names rank N's pid and tid as well.
            argv = child_argv(argv[1:])
        elif any("{ready_file}" in a for a in argv):
            import tempfile  # lazy: only for a command that names {ready_file}

            ready_file = Path(tempfile.mkdtemp(prefix="gpufault-exp-")) / "ready.json"
            argv = [a.replace("{ready_file}", str(ready_file)) for a in argv]
        env = dict(t.env)
        token = None
        if t.admin_token_env is not None:
            # A fresh admin token for the process it starts: its perturb
            # steps send it; nobody else knows it (the child's environment
            # is readable by its own user only).
            import secrets  # lazy: only for a target that gets an admin token

            token = secrets.token_urlsafe(32)
            env[t.admin_token_env] = token
        proc = TargetProcess(argv, t.ready, ready_file, t.start_timeout, env or None)
        proc.admin_token = token
        facts.update({k: v for k, v in proc.facts().items() if v is not None})
        if t.url:
            facts["url"] = t.url
    try:
        check_target(exp, facts)
    except BaseException:
        if proc is not None:
            proc.stop()
        raise
    return proc, facts


def check_target(exp: Experiment, facts: dict[str, Any]) -> None:
    """Before anything is armed: the URL answers TCP, the process runs."""
    where = str(exp.path)
    url = facts.get("url")
    if not url:
        raise ExperimentError(
            f"{where}: target.url: unknown (the ready line gave none): set target.url"
        )
    u = urlsplit(str(url))
    host, port = u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as e:
        raise ExperimentError(
            f"{where}: target.url: {url} is unreachable ({e.strerror or e}): "
            "start the service or fix the url"
        ) from None
    facts.update(url=str(url).rstrip("/"), host=host, port=port)
    pid = facts.get("pid")
    # lazy: pyctl.engine (difflib, mmap, +49 modules, ~200 ms) only when this runs
    from pyctl.engine import EngineError

    # lazy: keeps pyctl.runner (difflib, mmap, +52 modules, ~200 ms) off `--help`
    from pyctl.runner import check_target_pid

    try:
        check_target_pid(int(pid or 0), "target.pid")
    except EngineError as e:
        raise ExperimentError(f"{where}: target.pid: {e}") from None


def thread_by_name(pid: int, name: str) -> int | None:
    """The thread of pid whose comm is name (gf-worker), lowest tid first."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None
    for tid in tids:
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == name:
                return tid
        except OSError:
            continue
    return None


def _tgid(tid: int) -> int | None:
    """The process a thread id belongs to (/proc/TID/status Tgid)."""
    try:
        for ln in Path(f"/proc/{tid}/status").read_text().splitlines():
            if ln.startswith("Tgid:"):
                return int(ln.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def step_target(exp: Experiment, s: Step, facts: dict[str, Any]) -> tuple[int, int | None]:
    """The process (and thread) a fault step goes into: the target's pid,
    or the step's own `pid` / `tid` (a number or a fact such as
    {rank1_pid}), checked before anything is armed."""
    # lazy: pyctl.engine (difflib, mmap, +49 modules, ~200 ms) only when this runs
    from pyctl.engine import EngineError

    # lazy: keeps pyctl.runner (difflib, mmap, +52 modules, ~200 ms) off `--help`
    from pyctl.runner import check_target_pid

    key = f"{exp.path}: method[{s.idx + 1}]"

    def fact(name: str, text: str | None) -> int | None:
        if text is None:
            return None
        m = re.fullmatch(r"\{(\w+)\}", text)
        if m is None:
            return int(text)
        v = facts.get(m.group(1))
        if v is None:
            have = ", ".join(sorted(k for k in facts if k.endswith(("pid", "tid")))) or "none"
            raise ExperimentError(
                f"{key}.{name}: the target has no fact {m.group(1)!r} (it has {have}): "
                "start the target with that rank (--ranks 2) or give a number"
            )
        return int(v)

    tid = fact("tid", s.tid)
    pid = fact("pid", s.pid)
    if s.agent is not None:
        # Another node's process: its agent checks it when it arms (one
        # line back, the step failed); /proc here knows nothing of it.
        return int(pid if pid is not None else 0), tid
    if tid is not None:
        owner = _tgid(tid)
        if owner is None:
            raise ExperimentError(f"{key}.tid: no thread {tid} is running: fix the tid")
        if pid is not None and owner != pid:
            raise ExperimentError(
                f"{key}.tid: thread {tid} belongs to pid {owner}, not {pid}: fix one"
            )
        pid = owner
    if pid is None:
        pid = int(facts["pid"])
    elif s.pid is not None:
        try:
            check_target_pid(pid, f"method[{s.idx + 1}].pid")
        except EngineError as e:
            raise ExperimentError(f"{key}.pid: {e}") from None
    if s.thread and thread_by_name(pid, s.thread) is None:
        raise ExperimentError(f"{key}.thread: no thread {s.thread!r} in pid {pid}: fix the name")
    return pid, tid


class PidWatch:
    """When a process gpufault did not start ends: a thread waits on its
    pidfd (readable once it has exited; a later process that reuses the
    pid is another pidfd's) and notes the time."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.died_at: float | None = None
        self._stop = threading.Event()
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd, self.died_at = None, time.time()
            return
        self._thread = threading.Thread(target=self._run, name="gf-pidwatch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._fd is not None
        while not self._stop.is_set():
            # A timeout, not a wake-up pipe: stop() is once per experiment.
            if select.select([self._fd], [], [], 0.2)[0]:
                self.died_at = time.time()
                return

    def stop(self) -> None:
        if self._fd is None:
            return

        self._stop.set()
        self._thread.join(2)
        if not self._thread.is_alive():
            if self.died_at is None and select.select([self._fd], [], [], 0)[0]:
                self.died_at = time.time()  # between the thread's last look and now
            os.close(self._fd)
            self._fd = None


def died(proc: TargetProcess) -> str:
    """One line on a target that ended on its own: how, and its last words."""
    rc = proc.proc.returncode
    how = (
        f"killed by {signal.Signals(-rc).name}"
        if rc is not None and rc < 0 and -rc in signal.valid_signals()
        else f"exit status {rc}"
    )
    proc._reader.join(2)  # its last lines
    lines = [ln.strip() for ln in proc.lines if ln.strip()]
    # A C++ abort ends in a backtrace ("frame #37: ..."): the line that
    # says why comes before it (terminate called ..., what(): ...).
    why = [ln for ln in lines if _WHY.search(ln) and not ln.startswith("frame #")]
    tail = " | ".join(why[-2:] if why else lines[-3:])[-400:]
    return f"the target died during the experiment ({how})" + (
        f"; its last words: {tail}" if tail else ""
    )


_WHY = re.compile(r"terminate called|what\(\)|Error|error:|Traceback|Fatal|Aborted|Segmentation")


__all__ = [
    "REQUIREMENTS",
    "PidWatch",
    "TargetProcess",
    "check_target",
    "died",
    "host_has_gpu",
    "missing_on_host",
    "parse_target",
    "rank_facts",
    "start_target",
    "step_target",
    "thread_by_name",
]
