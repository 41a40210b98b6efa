"""What a session arms its faults in: a running process, one of its
threads, or a command gpufault starts (held before its first instruction
until every probe is in place)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyctl.api.errors import BadInput


@dataclass(frozen=True)
class Target:
    pid: int | None = None
    tid: int | None = None
    command: tuple[str, ...] = ()

    @classmethod
    def process(cls, pid: int) -> Target:
        return cls(pid=_positive(pid, "pid"))

    @classmethod
    def thread(cls, tid: int) -> Target:
        return cls(tid=_positive(tid, "tid"))

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
        return {"pid": self.pid, "tid": self.tid, "command": list(self.command)}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Target:
        cmd = d.get("command") or ()
        return cls(
            pid=d.get("pid"),  # type: ignore[arg-type]
            tid=d.get("tid"),  # type: ignore[arg-type]
            command=tuple(map(str, cmd)),  # type: ignore[call-overload]
        )


def _positive(v: int, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise BadInput(f"{what}: {v!r} is not a {what}: give a running one's id")
    return v


__all__ = ["Target"]
