"""NVML probes (pynvml, nvidia-ml-py): a GPU's memory used, or the Xid
critical-error events seen since the first sample (nvml)."""

from __future__ import annotations

from typing import Any, ClassVar

from pyctl.experiment.probes.base import _REQUIRED, Value, _Probe, _Table, _verdict
from pyctl.experiment.probes.tolerance import ProbeError


class NvmlProbe(_Probe):
    """NVML through pynvml (nvidia-ml-py): check = "memory_used" (bytes of
    device `device`) or "xids" (Xid critical-error events seen since the
    probe's first sample, default tolerance "== 0")."""

    kind = "nvml"
    CHECKS: ClassVar[dict[str, object]] = {"memory_used": _REQUIRED, "xids": "== 0"}

    def __init__(self, name: str, r: _Table) -> None:
        super().__init__(name, r)
        self.check = r.choice("check", tuple(self.CHECKS), "memory_used")
        self.device = r.get("device", (int,), "0", 0)
        dflt = self.CHECKS[self.check]
        self.tolerance = (
            r.tolerance("tolerance", dflt) if dflt is not _REQUIRED else r.tolerance("tolerance")
        )
        try:
            # lazy: pynvml is optional (the gpu extra), needed only on a GPU host
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            raise ProbeError(
                f'{r.where}: kind "nvml" needs pynvml, which is not importable here:'
                " pip install nvidia-ml-py (gpufault's gpu extra) on a host with an NVIDIA"
                " driver, or drop this probe"
            ) from None
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as e:
            raise ProbeError(
                f"{r.where}: NVML does not start ({e}): is the NVIDIA driver loaded?"
            ) from None
        if not 0 <= self.device < n:
            raise ProbeError(f"{r.where}.device: {self.device} is not a GPU here (0..{n - 1})")
        self._h = pynvml.nvmlDeviceGetHandleByIndex(self.device)
        self._reset()

    def _reset(self) -> None:
        self._events: Any = None
        self.xids: list[int] = []

    def _measure(self) -> tuple[bool, Value, str]:
        nv = self._nv
        if self.check == "memory_used":
            used = int(nv.nvmlDeviceGetMemoryInfo(self._h).used)
            ok = self.tolerance.check(used)
            return (
                ok,
                used,
                f"GPU {self.device} memory used {used} B ({_verdict(ok, self.tolerance)})",
            )
        if self._events is None:
            # Registration starts the count: Xids before the first sample
            # are not this experiment's.
            self._events = nv.nvmlEventSetCreate()
            nv.nvmlDeviceRegisterEvents(self._h, nv.nvmlEventTypeXidCriticalError, self._events)
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        while True:
            try:
                ev = wait(self._events, 0)
            except nv.NVMLError as e:
                if getattr(e, "value", None) == nv.NVML_ERROR_TIMEOUT:
                    break
                raise
            if ev.eventType == nv.nvmlEventTypeXidCriticalError:
                self.xids.append(int(ev.eventData))
        n = len(self.xids)
        ok = self.tolerance.check(n)
        seen = f" ({', '.join(map(str, self.xids[-5:]))})" if n else ""
        return ok, n, f"GPU {self.device}: {n} Xids{seen} ({_verdict(ok, self.tolerance)})"
