"""gpufa.ko in a qemu/TCG VM running Debian bookworm's 6.1 kernel and Debian
sid's 7.x kernel, with QEMU's edu PCI device behind a PCI bridge as the
watched device.

One VM boot per kernel runs kmod/tests/guest.py (the host's python3 and pyctl, inside
the guest), which exercises every anchor and writes what it saw to a shared
directory; the tests here judge it. The guest ends by printing a marker on
which the runner removes the edu device through the QEMU monitor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlite_utils

from pyctl.evidence.anchors import by_fault

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "vm"))
sys.path.insert(0, str(REPO / "kmod" / "tests"))
from kernels import KERNELS  # noqa: E402

try:
    import vmrun  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - the runner is another part of the repo
    vmrun = None

pytestmark = [pytest.mark.vm, pytest.mark.slow]

OUT = REPO / "build" / "kmod" / "vm-out"
UNPLUG = "GPUFA-UNPLUG-EDU-NOW"
EDU_ID0 = 0x010000ED  # edu BAR0 0x0: version 1.0, "ed"
GUEST_CHECKS = (
    "load_and_fire", "sysfs_reset", "reset_storm", "ioctl_reset", "tracepoint",
    "device_file_errors", "no_devices", "bad_params", "overflow", "concurrent_readers",
    "load_cycles", "driver_fire", "gone",
)  # fmt: skip


@pytest.fixture(scope="module", params=[k for k in KERNELS if KERNELS[k].vm])
def vm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vm_guest: Any
) -> dict[str, Any]:
    k = KERNELS[request.param]
    if vmrun is None:
        pytest.skip("vm/vmrun.py not importable")
    why = vmrun.kernel_available(k.vm)
    if why:
        pytest.skip(why)
    kdir = k.kdir()
    if kdir is None:
        pytest.skip(f"{k.name} kernel headers not fetched ({k.kdir_file}); run {k.fetch}")
    # The guest sees the host's root read-only, but not the host's /tmp:
    # build under the repo's build/.
    out = OUT / k.name
    proc = subprocess.run(
        ["make", "-C", str(REPO / "kmod"), f"KDIR={kdir}", f"OUT={out}", *k.make_args, "tests"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    share = tmp_path_factory.mktemp(f"kmod-vm-{k.name}")
    argv = [
        "python3", "kmod/tests/guest.py", str(out / "gpufa.ko"), str(share),
        "--fire-test-ko", str(out / "tests" / "gpufa_fire_test.ko"),
        "--unplug-marker", UNPLUG,
    ]  # fmt: skip
    # The session's guest of that kernel (conftest.vm_guest), edu included.
    res = vm_guest(k.vm).run(
        argv, cwd=REPO, rw=[share], qmp_on=[(UNPLUG, "device_del edu0")], timeout=420,
    )  # fmt: skip
    result_file = share / "result.json"
    assert result_file.exists(), (
        f"guest wrote no result (rc {res.rc}, {res.error}):\n" + (res.console[-4000:])
    )
    return {
        "kernel": k.name,
        "res": res,
        "r": json.loads(result_file.read_text()),
        "db": share / "anchors.db",
    }


def check(vm: dict[str, Any], name: str) -> Any:
    errors = vm["r"]["errors"]
    assert name not in errors, errors[name]
    assert name + ".cleanup" not in errors, errors[name + ".cleanup"]
    return vm["r"][name]


def recs(out: dict[str, Any], key: str = "records") -> list[dict[str, Any]]:
    return out[key]


def test_vm_ran_clean(vm: dict[str, Any], record_property: Any) -> None:
    res = vm["res"]
    record_property("vm_seconds", round(res.seconds, 1))
    record_property("guest_seconds", vm["r"]["guest_seconds"])
    print(f"{vm['kernel']}: VM wall {res.seconds:.1f} s, guest {vm['r']['guest_seconds']} s")
    assert res.rc == 0, (res.error, res.output[-3000:])
    assert res.splats == [], res.splats
    assert UNPLUG in res.fired
    log = (getattr(res, "dmesg", "") or "") + res.console
    assert "gpufa: 1 device(s), 3 reset probe(s), AER on" in log
    for bad in ("WARNING:", "BUG:", "Oops", "Call Trace", "general protection"):
        assert bad not in log
    assert vm["r"]["errors"] == {}
    assert set(GUEST_CHECKS) <= set(vm["r"])


def test_manual_fire_and_fault_context(vm: dict[str, Any]) -> None:
    out = check(vm, "load_and_fire")
    assert out["dev_mode"] == "0o600"
    a, b, c, d = recs(out)
    assert [r["kind"] for r in (a, b, c, d)] == ["manual"] * 4
    assert [r["code"] for r in (a, b, c, d)] == [11, 12, 13, 14]
    # No context: the module's own IDs; with the context: its ID and pid.
    assert (a["fault_id"], a["from_context"], a["ctx_pid"]) == ("kmod-1", False, 0)
    assert (b["fault_id"], b["from_context"], b["ctx_pid"]) == ("1a2b3c4d-7", True, 4242)
    assert c["fault_id"] == "kmod-2"
    # The other file's context died with it.
    assert (d["fault_id"], d["from_context"]) == ("kmod-3", False)
    assert [r["rec_seq"] for r in (a, b, c, d)] == [1, 2, 3, 4]
    assert all(r["comm"] == "python3" for r in (a, b, c, d))
    st = out["stats0"]
    assert (st["kprobes"], st["devices"], st["aer_hooked"], st["capacity"]) == (3, 1, 1, 64)
    assert out["stats1"]["records"] == 4 and out["stats1"]["overflow"] == 0


def test_record_snapshot_matches_device(vm: dict[str, Any]) -> None:
    out = check(vm, "load_and_fire")
    r = recs(out)[0]
    assert r["bdf"] == vm["r"]["bdf"]
    assert (r["vendor"], r["device"]) == (0x1234, 0x11E8)
    assert r["config_ok"]
    assert r["config"] == out["sysfs_config"]
    assert r["bar0"]["0x0"] == EDU_ID0
    assert r["bar0"]["0x100000"] is None  # past the 1 MiB BAR: not read
    assert r["bar0"]["0xffffc"] == 0xFFFFFFFF  # inside the BAR: read, edu answers ~0


def test_sysfs_reset_begin_end(vm: dict[str, Any]) -> None:
    out = check(vm, "sysfs_reset")
    begin, end = out["plain"]
    assert (begin["kind"], end["kind"]) == ("reset_begin", "reset_end")
    assert begin["fault_id"] == end["fault_id"] == "kmod-1"
    assert end["code"] == 0  # pci_reset_function's return value
    assert begin["mono_ns"] < end["mono_ns"]
    for r in (begin, end):
        assert r["config"] == out["config_before"] == out["config_after"]
        assert r["bar0"]["0x0"] == EDU_ID0
    cbegin, cend = out["ctx"]
    assert cbegin["fault_id"] == cend["fault_id"] == "00c0ffee-99"
    assert cbegin["ctx_pid"] == cend["ctx_pid"] == 77
    assert out["stats"]["rp_missed"] == 0


def test_reset_storm_pairs_and_no_false_gone(vm: dict[str, Any]) -> None:
    out = check(vm, "reset_storm")
    pairs = out["pairs"]
    want = [[kind, f"kmod-{i}"] for i in range(1, 21) for kind in ("reset_begin", "reset_end")]
    assert pairs == want
    assert out["stats"]["gone"] == 0
    assert out["stats"]["rp_missed"] == 0


def test_ioctl_reset_guarded(vm: dict[str, Any]) -> None:
    out = check(vm, "ioctl_reset")
    assert out["refused"] == "EPERM"
    assert out["allowed"] == "OK"
    begin, end = recs(out)
    assert (begin["kind"], end["kind"]) == ("reset_begin", "reset_end")
    assert begin["fault_id"] == end["fault_id"]


def test_tracepoint(vm: dict[str, Any]) -> None:
    out = check(vm, "tracepoint")
    (line,) = out["trace"]
    bdf = vm["r"]["bdf"]
    assert f"anchor: fault=00000000-1 kind=manual dev={bdf} id=1234:11e8 code=321" in line


def test_device_file_errors(vm: dict[str, Any]) -> None:
    out = check(vm, "device_file_errors")
    assert out.pop("stats")["records"] == 0
    assert out == {
        "empty_nonblock": "EAGAIN",
        "short_read": "EINVAL",
        "unknown_cmd": "ENOTTY",
        "ctx_zero": "EINVAL",
        "ctx_bad_ptr": "EFAULT",
        "stats_bad_ptr": "EFAULT",
        "fire_no_dev": "ENODEV",
        "fire_pad": "EINVAL",
        "fire_flags": "EINVAL",
        "write": "EBADF",
    }


def test_default_params_without_nvidia(vm: dict[str, Any]) -> None:
    out = check(vm, "no_devices")
    assert out["stats"]["devices"] == 0
    assert out["fire"] == "ENODEV"


def test_bad_params_refused(vm: dict[str, Any]) -> None:
    out = check(vm, "bad_params")
    want = {
        "devices_garbage": "EINVAL", "devices_absent": "ENODEV", "devices_range": "EINVAL",
        "bar0_unaligned": "EINVAL", "bar0_too_far": "EINVAL", "bar0_too_many": "EINVAL",
        "watchdog_small": "EINVAL", "fifo_small": "EINVAL", "fifo_big": "EINVAL",
    }  # fmt: skip
    assert {k: v["errno"] for k, v in out.items()} == want
    # Nothing left behind: no module, no device file.
    assert not any(v["left_loaded"] or v["left_dev"] for v in out.values())


def test_overflow_counted_exactly(vm: dict[str, Any]) -> None:
    out = check(vm, "overflow")
    st = out["stats"]
    assert (st["capacity"], st["records"], st["queued"], st["overflow"]) == (4, 10, 4, 6)
    # The oldest four are kept, the newest six dropped and counted.
    assert out["codes"] == [0, 1, 2, 3]
    assert out["rec_seqs"] == [1, 2, 3, 4]
    assert out["more"] is False
    assert out["after"] == [[99, 11]]
    assert out["stats_after"]["overflow"] == 6


def test_concurrent_readers(vm: dict[str, Any]) -> None:
    out = check(vm, "concurrent_readers")
    n = out["expected"]
    assert out["alive"] == 0
    # Every record was read exactly once, by one of the readers.
    assert out["seqs"] == list(range(1, n + 1))
    assert sorted(out["codes"]) == sorted([*range(n - 4), -1, -1, -1, -1])
    assert all(k >= 1 for k in out["per_reader"])
    assert out["stats"]["overflow"] == 0


def test_load_unload_cycles_with_blocked_reader(vm: dict[str, Any], record_property: Any) -> None:
    out = check(vm, "load_cycles")
    record_property("cycles_seconds", out["seconds"])
    print(f"{vm['kernel']}: {out['cycles']} insmod/rmmod cycles in {out['seconds']} s")
    assert out["cycles"] == 100
    # rmmod while a reader is blocked is refused (the open file pins the
    # module), never a crash; it succeeds once the reader is gone.
    assert out["busy"] == ["EAGAIN"]
    assert out["codes_ok"]
    assert out["loaded_after"] is False


def test_driver_gpufa_fire(vm: dict[str, Any]) -> None:
    out = check(vm, "driver_fire")
    (r,) = recs(out)
    assert (r["kind"], r["code"], r["bdf"]) == ("driver", 79, vm["r"]["bdf"])
    assert r["bar0"]["0x0"] == EDU_ID0


def test_device_gone(vm: dict[str, Any]) -> None:
    out = check(vm, "gone")
    (r,) = recs(out)
    assert r["kind"] == "gone"
    assert r["bdf"] == vm["r"]["bdf"]
    assert r["config_ok"] is False
    assert r["config"] == "ff" * 256
    # No MMIO on a device that is gone: every BAR0 value is marked unread.
    assert set(r["bar0"].values()) == {None}
    assert r["comm"].startswith("kworker")
    assert out["stats"]["gone"] == 1
    assert out["sysfs_present"] is False


def test_records_stored_by_fault_id(vm: dict[str, Any]) -> None:
    db = sqlite_utils.Database(vm["db"])
    assert db["anchors"].count == vm["r"]["stored"] > 0
    rows = by_fault(db, "00c0ffee-99")
    assert [r["kind"] for r in rows] == ["reset_begin", "reset_end"]
    assert all(len(r["config"]) == 256 for r in rows)
    assert json.loads(rows[0]["bar0"])["0x0000"] == EDU_ID0
    kinds = {r["kind"] for r in db["anchors"].rows}
    assert kinds == {"manual", "reset_begin", "reset_end", "driver", "gone"}
