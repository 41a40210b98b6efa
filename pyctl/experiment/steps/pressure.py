"""A pressure step: a second process holds a share of free VRAM (class 2).

    [[method]]
    pressure = { share = 1.0, fill = true, device = 0 }
    duration = "6s"

The step runs pyctl/hooks/vram_pressure.py as a child (`python -I`, the
same module `gpufault hooks vram-pressure` runs) with the step's duration:
the child allocates `share` of the GPU's free memory in chunks (cupy's
cudaMalloc, else torch), checks with NVML that it is held, and releases at
its own deadline, so the memory comes back on time even if this runner
hangs or is killed. The target never sees a fault of gpufault's: its own
allocations fail because the memory is gone, as they would under a
neighbour's job on a shared GPU.

Arming waits for the child's `holding` line (the memory is taken); its
`released` line (at the deadline, or after stop()'s SIGTERM) ends the step.
Evidence, as `hooks vram-pressure` keeps it (pyctl/hooks/record.py): a run
(`hooks:vram-pressure`, mechanism `vram-hold`) and one fault (action
`pressure`: share, bytes held, NVML before and after, release reason).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any

from pyctl import paths
from pyctl.experiment.steps.base import FaultHostError, StepKind, register

if TYPE_CHECKING:
    from pyctl.experiment.model import Step
    from pyctl.experiment.reader import Reader
    from pyctl.experiment.steps.base import Run, StepRun


class PressureRun:
    """A pressure step behind the RunningFault interface."""

    def __init__(
        self, spec: dict[str, Any], duration: float, db_path: str, arm_timeout: float
    ) -> None:
        # lazy: keeps pyctl.hooks.record (+8 modules) off `--help`
        from pyctl.hooks.record import VramRun

        self.spec = {**spec, "duration": duration}
        args = ["--share", str(spec["share"]), "--duration", f"{duration:g}",
                "--device", str(spec["device"]), "--allocator", str(spec["allocator"]),
                "--reserve-mib", str(spec["reserve_mib"]),
                *(["--fill"] if spec.get("fill") else [])]  # fmt: skip
        self.argv = paths.module_argv("pyctl.hooks.vram_pressure", args)
        self.rec = VramRun(db_path, ["experiment", "pressure", *args], self.spec)
        self.started_at = time.time()
        self._ended_at: float | None = None
        self.held_at: float | None = None
        self.lines: list[str] = []  # the child's stderr, for a refusal's reason
        self.run_id = ""  # the hooks' run, once the child holds (VramRun writes it)
        self._holding = threading.Event()
        self._done = threading.Event()
        self._news = threading.Event()  # holding or done, whichever comes first
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        threading.Thread(target=self._errors, name="gf-exp-pressure-err", daemon=True).start()
        threading.Thread(target=self._read, name="gf-exp-pressure", daemon=True).start()
        # Armed once the memory is held, or the child gave up (its reason).
        self._news.wait(arm_timeout)
        if not self._holding.is_set():
            gave_up = self._done.is_set()  # it exited by itself; else it was too slow
            self.stop()
            self._done.wait(10)
            why = next((ln for ln in reversed(self.lines) if ln.strip()), "")
            when = "" if gave_up else f" in {arm_timeout:g}s"
            raise FaultHostError(
                f"vram pressure did not hold memory{when} ({why or f'exit {self.proc.poll()}'})"
            )
        self.started_at = self.held_at or time.time()

    def _errors(self) -> None:
        assert self.proc.stderr is not None
        for ln in self.proc.stderr:
            self.lines.append(ln.rstrip("\n"))
            del self.lines[:-50]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            self.rec.event(ev)
            self.run_id = self.rec.run_id
            if ev.get("event") == "holding":
                self.held_at = time.time()
                self._holding.set()
                self._news.set()
        code = self.proc.wait()
        self.rec.end(code)
        self._ended_at = time.time()
        self._done.set()
        self._news.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # it releases and says so

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def fires(self) -> list[tuple[str, float]]:
        return [(f"{self.run_id}-1", self.held_at)] if self.held_at and self.run_id else []

    @property
    def ended_at(self) -> float | None:
        return self._ended_at

    @property
    def rc(self) -> int | None:
        return self.proc.returncode if self._done.is_set() else None

    @property
    def what(self) -> str:
        out = self.rec.outcome
        gib = (out.get("bytes_held") or 0) / 2**30
        return f"holding {gib:.1f} GiB of GPU {self.spec['device']} (run {self.run_id}"


def parse_pressure(r: Reader, key: str, v: Any) -> dict[str, Any]:
    """A pressure step's table: what pyctl/hooks/vram_pressure.py takes."""
    if not isinstance(v, dict):
        raise r.err(key, 'expected {share = 0.9, device = 0, allocator = "auto"}')
    r.keys(v, key, {"share", "device", "allocator", "reserve_mib", "fill"})
    share = r.num(v, key, "share", what="the share of free memory (0.9)")
    if not 0 < share <= 1:
        raise r.err(f"{key}.share", f"{share:g}: the share of FREE memory, 0 < share <= 1")
    allocator = r.str_(v, key, "allocator", "auto")
    if allocator not in ("auto", "cupy", "torch", "host-double"):
        raise r.err(f"{key}.allocator", f"{allocator!r}: use auto, cupy or torch")
    return {
        "share": share,
        "device": r.int_(v, key, "device", 0),
        "allocator": allocator,
        "reserve_mib": r.int_(v, key, "reserve_mib", 0),
        "fill": r.bool_(v, key, "fill", False),
    }


class PressureKind(StepKind):
    name = "pressure"
    words = ("pressure",)
    # It waits for its child to hold: it may have arm_timeout.
    refused = ("thread", "pid", "tid", "set")
    why = "a pressure step is a process of its own: remove it"

    def parse(self, r: Reader, key: str, m: dict[str, Any], step: Step) -> Step:
        table = parse_pressure(r, f"{key}.pressure", m["pressure"])
        step.name = r.str_(m, key, "name", f"vram pressure {table['share']:g}")
        step.thread, step.pressure = None, table
        return step

    def arm(self, run: Run, sr: StepRun, pending: Any, facts: dict[str, Any]) -> Any:
        s = sr.step
        assert s.pressure is not None
        return PressureRun(
            s.pressure,
            s.duration,
            run.db_path,
            s.arm_timeout or float(getattr(run.host, "arm_timeout", 60.0)),
        )

    def spec(self, step: Step) -> dict[str, Any]:
        return {"pressure": step.pressure}


register(PressureKind())

__all__ = ["PressureKind", "PressureRun", "parse_pressure"]
