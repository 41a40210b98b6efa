#!/usr/bin/env python3
"""The gpufa checks that run inside the test VM (tests/test_kmod_vm.py).

Runs as root in the guest with the host's python3 and pyctl; loads the
built gpufa.ko against QEMU's edu device, exercises every anchor and the
device file, and writes what it saw to OUTDIR/result.json plus the records
to OUTDIR/anchors.db. It asserts nothing itself: each check
stores facts (or the error it hit) and pytest judges them on the host.

usage: guest.py KO OUTDIR [--fire-test-ko KO2] [--unplug-marker TEXT]
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import select
import sqlite3
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyctl.anchors import AnchorDevice, uapi
from pyctl.anchors.device import raw_ioctl
from pyctl.anchors.modload import insmod, loaded, rmmod
from pyctl.anchors.record import AnchorRecord
from pyctl.evidence.anchors import store_records
from pyctl.evidence.sqlitedb import Database

EDU = ("0x1234", "0x11e8")
# 0x0 identification, 0x4 liveness, 0x8 factorial; 0xffffc inside the 1 MiB
# BAR; 0x100000 past its end (must come back as "not read").
BAR0 = "0x0,0x4,0x8,0xffffc,0x100000"
TRACE = "/sys/kernel/tracing"

result: dict[str, Any] = {"errors": {}}
all_records: list[AnchorRecord] = []


def check(fn: Callable[[Any], Any]) -> Callable[[Any], None]:
    """Run one check; keep its facts or its traceback under its name."""

    def run(self: Any) -> None:
        t0 = time.monotonic()
        try:
            result[fn.__name__] = fn(self)
        except Exception:  # noqa: BLE001 - reported to pytest, not hidden
            result["errors"][fn.__name__] = traceback.format_exc()
        result.setdefault("seconds", {})[fn.__name__] = round(time.monotonic() - t0, 3)
        # Never leave the module loaded for the next check.
        if loaded("gpufa"):
            try:
                rmmod("gpufa")
            except OSError as e:
                result["errors"].setdefault(fn.__name__ + ".cleanup", str(e))

    run.__name__ = fn.__name__
    return run


def find_edu() -> str:
    for d in sorted(glob.glob("/sys/bus/pci/devices/*")):
        ids = (Path(d, "vendor").read_text().strip(), Path(d, "device").read_text().strip())
        if ids == EDU:
            return os.path.basename(d)
    raise RuntimeError("no edu device in the guest (was the VM started with edu=True?)")


def rec_dict(r: AnchorRecord) -> dict[str, Any]:
    return {
        "kind": r.kind,
        "fault_id": r.fault_id,
        "from_context": r.from_context,
        "rec_seq": r.rec_seq,
        "bdf": r.bdf,
        "vendor": r.vendor,
        "device": r.device,
        "code": r.code,
        "pid": r.pid,
        "ctx_pid": r.ctx_pid,
        "comm": r.comm,
        "config_ok": r.config_ok,
        "config": r.config.hex(),
        "bar0": {f"0x{k:x}": v for k, v in r.bar0.items()},
        "mono_ns": r.mono_ns,
        "wall_ns": r.wall_ns,
    }


def errno_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e.errno))
    return "OK"


def take(dev: AnchorDevice, n: int, timeout: float = 20) -> list[AnchorRecord]:
    recs = dev.read_until(n, timeout)
    all_records.extend(recs)
    return recs


class Guest:
    def __init__(self, ko: str, fire_ko: str | None, marker: str | None) -> None:
        self.ko = ko
        self.fire_ko = fire_ko
        self.marker = marker
        self.bdf = find_edu()
        self.sysfs = f"/sys/bus/pci/devices/{self.bdf}"
        self.params = f"devices={self.bdf} bar0={BAR0} watchdog_ms=100"
        result["bdf"] = self.bdf

    def sysfs_config(self) -> str:
        return Path(self.sysfs, "config").read_bytes()[: uapi.CFG_SIZE].hex()

    @check
    def load_and_fire(self) -> dict[str, Any]:
        """Manual fire without and with a fault context; BAR0 and config."""
        insmod(self.ko, self.params)
        out: dict[str, Any] = {"dev_mode": oct(os.stat("/dev/gpufa").st_mode & 0o777)}
        cfg = self.sysfs_config()
        with AnchorDevice() as dev:
            out["stats0"] = dev.stats()
            dev.fire(self.bdf, code=11)
            dev.set_context("1a2b3c4d-7", pid=4242)
            dev.fire(None, code=12)
            dev.clear_context()
            dev.fire(self.bdf, code=13)
            # A context set through a file is cleared when that file closes.
            with AnchorDevice() as other:
                other.set_context("0badcafe-3")
            dev.fire(self.bdf, code=14)
            out["records"] = [rec_dict(r) for r in take(dev, 4)]
            out["stats1"] = dev.stats()
        out["sysfs_config"] = cfg
        return out

    @check
    def sysfs_reset(self) -> dict[str, Any]:
        """Reset through sysfs: begin and end share a fault ID."""
        insmod(self.ko, self.params)
        out: dict[str, Any] = {"config_before": self.sysfs_config()}
        with AnchorDevice() as dev:
            Path(self.sysfs, "reset").write_text("1")
            out["plain"] = [rec_dict(r) for r in take(dev, 2)]
            dev.set_context("00c0ffee-99", pid=77)
            Path(self.sysfs, "reset").write_text("1")
            dev.clear_context()
            out["ctx"] = [rec_dict(r) for r in take(dev, 2)]
            out["stats"] = dev.stats()
        out["config_after"] = self.sysfs_config()
        return out

    @check
    def reset_storm(self) -> dict[str, Any]:
        """20 resets with the watchdog every 10 ms: 20 begin/end pairs and
        no false "gone" from a device caught in the middle of a reset."""
        insmod(self.ko, self.params.replace("watchdog_ms=100", "watchdog_ms=10"))
        with AnchorDevice() as dev:
            for _ in range(20):
                Path(self.sysfs, "reset").write_text("1")
            recs = take(dev, 40, timeout=5)
            st = dev.stats()
        return {"pairs": [(r.kind, r.fault_id) for r in recs], "stats": st}

    @check
    def ioctl_reset(self) -> dict[str, Any]:
        """GPUFA_IOC_RESET: refused unless allow_reset=1, then a real reset."""
        out: dict[str, Any] = {}
        insmod(self.ko, self.params)
        with AnchorDevice() as dev:
            out["refused"] = errno_of(lambda: dev.reset(self.bdf))
        rmmod("gpufa")
        insmod(self.ko, self.params + " allow_reset=1")
        with AnchorDevice() as dev:
            out["allowed"] = errno_of(lambda: dev.reset(self.bdf))
            out["records"] = [rec_dict(r) for r in take(dev, 2)]
        return out

    @check
    def tracepoint(self) -> dict[str, Any]:
        insmod(self.ko, self.params)
        enable = Path(TRACE, "events/gpufa/anchor/enable")
        Path(TRACE, "trace").write_text("")
        enable.write_text("1")
        with AnchorDevice() as dev:
            dev.fire(self.bdf, code=321)
            recs = take(dev, 1)
        enable.write_text("0")
        lines = [ln for ln in Path(TRACE, "trace").read_text().splitlines() if "anchor:" in ln]
        return {"records": [rec_dict(r) for r in recs], "trace": lines}

    @check
    def device_file_errors(self) -> dict[str, Any]:
        """Bad reads and bad ioctls are refused with an errno."""
        insmod(self.ko, self.params)
        out: dict[str, Any] = {}
        with AnchorDevice(nonblock=True) as dev:
            fd = dev.fileno()
            out["empty_nonblock"] = errno_of(lambda: os.read(fd, uapi.RECORD_SIZE))
            out["short_read"] = errno_of(lambda: os.read(fd, uapi.RECORD_SIZE - 1))
            out["unknown_cmd"] = errno_of(lambda: raw_ioctl(fd, 0x4700 | 0x7F))
            out["ctx_zero"] = errno_of(lambda: raw_ioctl(fd, uapi.IOC_SET_CTX, uapi.Ctx(0, 0, 0)))
            out["ctx_bad_ptr"] = errno_of(lambda: raw_ioctl(fd, uapi.IOC_SET_CTX, 16))
            out["stats_bad_ptr"] = errno_of(lambda: raw_ioctl(fd, uapi.IOC_STATS, 16))
            out["fire_no_dev"] = errno_of(lambda: dev.fire("0000:7f:1f.7"))
            out["fire_pad"] = errno_of(
                lambda: raw_ioctl(fd, uapi.IOC_FIRE, uapi.Fire(0, 0, 0, uapi.FIRE_ANY, 0, 1))
            )
            out["fire_flags"] = errno_of(
                lambda: raw_ioctl(fd, uapi.IOC_FIRE, uapi.Fire(0, 0, 0, 0x80, 0, 0))
            )
            out["write"] = errno_of(lambda: os.write(fd, b"x"))
            out["stats"] = dev.stats()
        return out

    @check
    def no_devices(self) -> dict[str, Any]:
        """Default parameters on a machine without NVIDIA: loads, watches none."""
        insmod(self.ko, "")
        with AnchorDevice() as dev:
            return {"stats": dev.stats(), "fire": errno_of(lambda: dev.fire(None))}

    @check
    def bad_params(self) -> dict[str, Any]:
        cases = {
            "devices_garbage": f"devices=zz:zz bar0={BAR0}",
            "devices_absent": "devices=0000:7f:1f.7",
            "devices_range": "devices=0000:00:20.0",
            "bar0_unaligned": f"devices={self.bdf} bar0=0x3",
            "bar0_too_far": f"devices={self.bdf} bar0=0x1000000",
            "bar0_too_many": f"devices={self.bdf} bar0=" + ",".join(str(4 * i) for i in range(17)),
            "watchdog_small": f"devices={self.bdf} watchdog_ms=5",
            "fifo_small": f"devices={self.bdf} fifo_records=1",
            "fifo_big": f"devices={self.bdf} fifo_records=5000",
        }
        out: dict[str, Any] = {}
        for name, params in cases.items():
            err = errno_of(lambda p=params: insmod(self.ko, p))  # type: ignore[misc]
            out[name] = {
                "errno": err,
                "left_loaded": loaded("gpufa"),
                "left_dev": os.path.exists("/dev/gpufa"),
            }
            if loaded("gpufa"):
                rmmod("gpufa")
        return out

    @check
    def overflow(self) -> dict[str, Any]:
        """A 4-record fifo and 10 fires: 4 kept, exactly 6 counted lost."""
        insmod(self.ko, self.params + " fifo_records=4")
        with AnchorDevice() as dev:
            for i in range(10):
                dev.fire(self.bdf, code=i)
            st = dev.stats()
            recs = take(dev, 4, timeout=2)
            # Nothing more may arrive: the fifo held 4.
            more = dev.wait(0.5)
            # After draining, the fifo takes records again.
            dev.fire(self.bdf, code=99)
            after = take(dev, 1)
            st2 = dev.stats()
        return {
            "stats": st,
            "codes": [r.code for r in recs],
            "rec_seqs": [r.rec_seq for r in recs],
            "more": more,
            "after": [(r.code, r.rec_seq) for r in after],
            "stats_after": st2,
        }

    @check
    def concurrent_readers(self) -> dict[str, Any]:
        """Four blocking readers share 400 records: each record read once."""
        nreaders, nfires = 4, 400
        insmod(self.ko, self.params + " fifo_records=512")
        got: list[list[tuple[int, int]]] = [[] for _ in range(nreaders)]

        def reader(i: int) -> None:
            with AnchorDevice() as dev:
                while True:
                    # One record per read so the stop markers spread out.
                    for r in dev.read(1):
                        got[i].append((r.rec_seq, r.code))
                        if r.code == -1:
                            return

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(nreaders)]
        for t in threads:
            t.start()
        with AnchorDevice() as dev:
            for i in range(nfires):
                dev.fire(self.bdf, code=i)
            for _ in range(nreaders):
                dev.fire(self.bdf, code=-1)
            for t in threads:
                t.join(timeout=120)
            st = dev.stats()
        return {
            "alive": sum(t.is_alive() for t in threads),
            "per_reader": [len(g) for g in got],
            "seqs": sorted(s for g in got for s, _ in g),
            "codes": sorted(c for g in got for _, c in g),
            "expected": nfires + nreaders,
            "stats": st,
        }

    @check
    def load_cycles(self) -> dict[str, Any]:
        """100 insmod/rmmod cycles, each with a reader blocked in read()."""
        cycles = 100
        busy: list[str] = []
        codes: list[int] = []
        t0 = time.monotonic()
        for i in range(cycles):
            insmod(self.ko, self.params)
            dev = AnchorDevice()
            box: list[AnchorRecord] = []
            t = threading.Thread(target=lambda d=dev, b=box: b.extend(d.read()))
            t.start()
            wait_blocked_in_read(t, dev.fileno())
            busy.append(errno_of(lambda: rmmod("gpufa")))
            dev.fire(self.bdf, code=i)  # wakes the reader
            t.join(timeout=30)
            codes.extend(r.code for r in box)
            dev.close()
            rmmod("gpufa")
        seconds = time.monotonic() - t0
        return {
            "cycles": cycles,
            "seconds": round(seconds, 3),
            "busy": sorted(set(busy)),
            "codes_ok": codes == list(range(cycles)),
            "loaded_after": loaded("gpufa"),
        }

    @check
    def driver_fire(self) -> dict[str, Any]:
        """A cooperating driver (the gpufa_fire_test module) calls gpufa_fire()."""
        if not self.fire_ko:
            return {"skipped": "no gpufa_fire_test.ko given"}
        insmod(self.ko, self.params)
        with AnchorDevice() as dev:
            insmod(self.fire_ko, f"devices={self.bdf} code=79")
            rmmod("gpufa_fire_test")
            recs = take(dev, 1)
        return {"records": [rec_dict(r) for r in recs]}

    @check
    def gone(self) -> dict[str, Any]:
        """Last: the host removes the device; the watchdog reports it."""
        if not self.marker:
            return {"skipped": "no --unplug-marker given"}
        insmod(self.ko, self.params.replace("watchdog_ms=100", "watchdog_ms=50"))
        with AnchorDevice() as dev:
            print(self.marker, flush=True)  # vmrun sends device_del edu0 on it
            t0 = time.monotonic()
            recs = take(dev, 1, timeout=60)
            waited = time.monotonic() - t0
            st = dev.stats()
        rmmod("gpufa")
        return {
            "records": [rec_dict(r) for r in recs],
            "waited": round(waited, 3),
            "stats": st,
            "sysfs_present": os.path.exists(self.sysfs),
        }


def wait_blocked_in_read(t: threading.Thread, fd: int) -> None:
    """Until the thread sits in read(fd): /proc's syscall file names the
    system call (0 = read on x86-64) and its first argument."""
    want = f"0 {hex(fd)} "
    path = f"/proc/self/task/{t.native_id}/syscall"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if Path(path).read_text().startswith(want):
            return
        select.select([], [], [], 0.001)
    raise TimeoutError(f"reader thread never blocked in read({fd})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ko")
    ap.add_argument("outdir")
    ap.add_argument("--fire-test-ko")
    ap.add_argument("--unplug-marker")
    args = ap.parse_args()
    t0 = time.monotonic()
    g = Guest(args.ko, args.fire_test_ko, args.unplug_marker)
    for name in (
        "load_and_fire",
        "sysfs_reset",
        "reset_storm",
        "ioctl_reset",
        "tracepoint",
        "device_file_errors",
        "no_devices",
        "bad_params",
        "overflow",
        "concurrent_readers",
        "load_cycles",
        "driver_fire",
        "gone",
    ):
        getattr(g, name)()
    db = Database(sqlite3.connect(os.path.join(args.outdir, "anchors.db")))
    result["stored"] = store_records(db, all_records)
    result["guest_seconds"] = round(time.monotonic() - t0, 3)
    result["record_size"] = uapi.RECORD_SIZE
    Path(args.outdir, "result.json").write_text(json.dumps(result, indent=1))
    print(f"guest: {len(result['errors'])} error(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
