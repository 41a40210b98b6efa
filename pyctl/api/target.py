"""What a session arms its faults in: a running process, one of its
threads, a command gpufault starts (held before its first instruction
until every probe is in place), or a selector that names processes by
where they run: a container, a cgroup, a pod, a process name, the ranks
of a job (pyctl/targets/select.py). A selector is resolved when the
session arms: one process gives one session, several a SessionGroup of
one session each (docs/containers.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pyctl.api.errors import BadInput

SELECTORS = ("container", "cgroup", "pod", "comm", "ranks_of")


@dataclass(frozen=True)
class Target:
    pid: int | None = None
    tid: int | None = None
    command: tuple[str, ...] = ()
    selector: str = ""  # one of SELECTORS; resolved by members()
    value: str = ""  # the selector's argument (a name, a path, a pid)
    thread_name: str = ""  # only the threads of this name (of pid or the selection)
    # Who a resolved member is besides its pid (rank, the selector, the
    # container's name): written into its run's targets row.
    labels: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def process(cls, pid: int) -> Target:
        return cls(pid=_positive(pid, "pid"))

    @classmethod
    def thread(cls, tid: int) -> Target:
        return cls(tid=_positive(tid, "tid"))

    @classmethod
    def container(cls, name_or_id: str) -> Target:
        """Every process of a container (crun, runc, containerd, Docker,
        CRI-O, Podman: by name, id or unique id prefix)."""
        return cls(selector="container", value=_word(name_or_id, "container"))

    @classmethod
    def cgroup(cls, path: str) -> Target:
        """Every process in a cgroup or below it (/system.slice/x.service,
        or its directory under /sys/fs/cgroup)."""
        return cls(selector="cgroup", value=_word(path, "cgroup"))

    @classmethod
    def pod(cls, namespace_name: str) -> Target:
        """Every process of a Kubernetes pod on this node: NAMESPACE/NAME,
        or NAMESPACE/NAME/CONTAINER for one of its containers."""
        return cls(selector="pod", value=_word(namespace_name, "pod"))

    @classmethod
    def comm(cls, name: str) -> Target:
        """Every process of this name (a glob matches several)."""
        return cls(selector="comm", value=_word(name, "comm"))

    @classmethod
    def ranks_of(cls, pid: int) -> Target:
        """The ranks of a multi-process job: pid (torchrun, mpirun, the
        first rank) and its descendants that map the faults' library,
        each tagged with its rank (RANK, else pid order)."""
        return cls(selector="ranks_of", value=str(_positive(pid, "pid")))

    def threads(self, name: str) -> Target:
        """Only the threads of this name, of this target's process(es)."""
        if self.command:
            raise BadInput("threads(): a started command has no threads yet: give a pid")
        return replace(self, thread_name=_word(name, "thread name"))

    def members(self, libs: Sequence[str] = ()) -> list[Target]:
        """This target resolved now: one Target per process (or thread),
        each with its labels. libs: the faults' libraries (ranks_of keeps
        the processes that map one). Raises BadInput with what runs instead."""
        if not self.selector and not self.thread_name:
            return [self]
        # lazy: keeps pyctl.targets (+4 modules) off `import gpufault`
        from pyctl.targets import select

        if self.selector:
            ms = select.resolve(self.selector, self.value, libs=libs, thread=self.thread_name,
                                same=_maps_same_build)  # fmt: skip
        else:
            pid = self.pid
            if pid is None:
                raise BadInput("threads(): give the process as Target.process(PID).threads(NAME)")
            ms = select.resolve("pid", pid, thread=self.thread_name)
        return [Target(pid=m.pid, tid=m.tid, labels=tuple(sorted(m.labels.items()))) for m in ms]

    @classmethod
    def run(cls, argv: Sequence[str]) -> Target:
        """A command to start; its exit ends the session."""
        if isinstance(argv, str) or not argv:
            raise BadInput("Target.run: give the command as a list, e.g. ['./app', 'ARG']")
        return cls(command=tuple(map(str, argv)))

    @classmethod
    def of(cls, what: Target | int | Sequence[str]) -> Target:
        """A Target, a pid, or an argv list."""
        if isinstance(what, Target):
            return what
        if isinstance(what, int) and not isinstance(what, bool):
            return cls.process(what)
        if isinstance(what, (list, tuple)):
            return cls.run(what)
        raise BadInput(
            f"target {what!r}: give a pid, an argv list or gpufault.Target.process/thread/run"
        )

    def describe(self) -> str:
        if self.selector:
            what = f"{self.selector.replace('_', '-')} {self.value}"
            return what + (f", threads {self.thread_name}" if self.thread_name else "")
        if self.thread_name:
            return f"pid {self.pid}, threads {self.thread_name}"
        if self.tid:
            return f"tid {self.tid}"
        if self.pid:
            return f"pid {self.pid}"
        return " ".join(self.command)

    def to_runner(self):  # type: ignore[no-untyped-def]
        # lazy: keeps pyctl.runner (+64 modules, ~400 ms) off `import gpufault`
        from pyctl.runner import Target as RunnerTarget

        return RunnerTarget(pid=self.pid, tid=self.tid, cmd=self.command)

    def to_json(self) -> dict[str, object]:
        d: dict[str, object] = {"pid": self.pid, "tid": self.tid, "command": list(self.command)}
        if self.selector:
            d.update(selector=self.selector, value=self.value)
        if self.thread_name:
            d["thread_name"] = self.thread_name
        if self.labels:
            d["labels"] = dict(self.labels)
        return d

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Target:
        cmd = d.get("command") or ()
        sel = str(d.get("selector") or "")
        if sel and sel not in SELECTORS:
            raise BadInput(f"target selector {sel!r}: one of {', '.join(SELECTORS)}")
        labels = d.get("labels") or {}
        if not isinstance(labels, dict):
            raise BadInput("target labels: give an object of names to values")
        return cls(
            pid=d.get("pid"),  # type: ignore[arg-type]
            tid=d.get("tid"),  # type: ignore[arg-type]
            command=tuple(map(str, cmd)),  # type: ignore[call-overload]
            selector=sel,
            value=str(d.get("value") or ""),
            thread_name=str(d.get("thread_name") or ""),
            labels=tuple(sorted((str(k), v) for k, v in labels.items())),
        )


def _word(v: str, what: str) -> str:
    if not isinstance(v, str) or not v.strip() or "\0" in v or "\n" in v:
        raise BadInput(f"{what}: {v!r} is not a {what}: give it as the runtime or ps shows it")
    return v.strip()


def _positive(v: int, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise BadInput(f"{what}: {v!r} is not a {what}: give a running one's id")
    return v


__all__ = ["Target"]


def _maps_same_build(pid: int, lib: str) -> bool:
    """Whether pid maps the file at lib or, in another root (a container),
    a copy of its build: what find_library resolves lib to there."""
    # lazy: keeps pyctl.symbols.resolve (+3 modules) off `import gpufault`
    from pyctl.symbols import resolve

    try:
        return resolve.find_library(lib, pid).mapped
    except resolve.ResolveError:
        return False
