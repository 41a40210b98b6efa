"""/dev/gpufa: read anchor records, set the fault context, fire, stats."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import select
from types import TracebackType

from pyctl.anchors import uapi
from pyctl.anchors.record import AnchorRecord, decode, parse_bdf, parse_fault_id

DEFAULT_PATH = "/dev/gpufa"


class AnchorDevice:
    """An open /dev/gpufa. Closing it clears a fault context it set."""

    def __init__(self, path: str = DEFAULT_PATH, *, nonblock: bool = False) -> None:
        self.fd = -1
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_NONBLOCK if nonblock else 0)
        try:
            self.fd = os.open(path, flags)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT, f"{path} does not exist: load the module (insmod gpufa.ko)", path
            ) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> AnchorDevice:
        return self

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def fileno(self) -> int:
        return self.fd

    def read(self, max_records: int = 64) -> list[AnchorRecord]:
        """Whole records; blocks unless opened nonblock (then BlockingIOError)."""
        return decode(os.read(self.fd, uapi.RECORD_SIZE * max_records))

    def wait(self, timeout: float | None) -> bool:
        """True when a record can be read, False on timeout."""
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        return bool(p.poll(None if timeout is None else int(timeout * 1000)))

    def read_until(self, count: int, timeout: float) -> list[AnchorRecord]:
        """At least count records, or what came before timeout seconds passed
        without a new record arriving."""
        out: list[AnchorRecord] = []
        while len(out) < count and self.wait(timeout):
            try:
                out.extend(self.read())
            except BlockingIOError:
                continue  # another reader took them
        return out

    def set_context(self, fault_id: str, pid: int = 0) -> None:
        run_id, seq = parse_fault_id(fault_id)
        # the module's uapi carries the run id's random half (a u32); its
        # records come back with that half and are stored under the full id
        # again (pyctl/evidence/anchors.py)
        fcntl.ioctl(self.fd, uapi.IOC_SET_CTX, uapi.Ctx(seq, run_id & 0xFFFFFFFF, pid))

    def clear_context(self) -> None:
        fcntl.ioctl(self.fd, uapi.IOC_CLEAR_CTX)

    def _target(self, bdf: str | None, code: int) -> uapi.Fire:
        if bdf is None:
            return uapi.Fire(0, 0, 0, uapi.FIRE_ANY, code, 0)
        dom, bus, devfn = parse_bdf(bdf)
        return uapi.Fire(dom, bus, devfn, 0, code, 0)

    def fire(self, bdf: str | None = None, code: int = 0) -> None:
        """A manual anchor on a watched device (None: the first one)."""
        fcntl.ioctl(self.fd, uapi.IOC_FIRE, self._target(bdf, code))

    def reset(self, bdf: str | None = None) -> None:
        """A real function reset (the module must be loaded with allow_reset=1)."""
        fcntl.ioctl(self.fd, uapi.IOC_RESET, self._target(bdf, 0))

    def stats(self) -> dict[str, int]:
        st = uapi.Stats()
        fcntl.ioctl(self.fd, uapi.IOC_STATS, st)
        return {f[0]: getattr(st, f[0]) for f in uapi.Stats._fields_}


def raw_ioctl(fd: int, cmd: int, arg: int | ctypes.Structure | bytes = 0) -> int | bytes:
    """An ioctl with any argument, for tests that send bad requests on purpose."""
    return fcntl.ioctl(fd, cmd, arg)  # type: ignore[call-overload]
