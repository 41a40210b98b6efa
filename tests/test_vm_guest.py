"""The shared guest (vm/guest.py, conftest.vm_guest): jobs on one booted
bookworm guest stay independent. A job leaves a process, a file in /tmp, a
pinned BPF map, an enabled uprobe event and a removed edu device; the next
job finds none of it (and the edu device back at its address), and a job
that hangs takes the guest down for a new one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "vm"))

import vmrun  # noqa: E402

pytestmark = [pytest.mark.vm, pytest.mark.root]

UNPLUG = "GF-TEST-GUEST-UNPLUG"
EDU = "grep -l 0x11e8 /sys/bus/pci/devices/*/device"
# Runs in the guest under the host's python3.
LITTER = r"""
import os, select, socket, subprocess, sys
subprocess.Popen(["sleep", "600"], start_new_session=True)
open("/tmp/gf-litter", "w").write("litter")
subprocess.run(["bpftool", "map", "create", "/sys/fs/bpf/gf_litter", "type", "array",
                "key", "4", "value", "4", "entries", "1", "name", "gf_litter"], check=True)
T = "/sys/kernel/tracing/"
fd = os.open(T + "uprobe_events", os.O_WRONLY | os.O_APPEND)
os.write(fd, b"p:gflitter/entry %s:0\n" % os.path.realpath("/bin/true").encode())
os.close(fd)
open(T + "events/gflitter/entry/enable", "w").write("1")
edu = next(d for d in sorted(os.listdir("/sys/bus/pci/devices"))
           if open("/sys/bus/pci/devices/%s/device" % d).read().strip() == "0x11e8")
print("edu=/sys/bus/pci/devices/%s/device" % edu, flush=True)
# The kernel's remove uevent for the device, so the job ends with it gone.
s = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)
s.bind((0, 1))
devpath = os.path.realpath("/sys/bus/pci/devices/" + edu)[len("/sys"):]
print(sys.argv[1], flush=True)
while select.select([s], [], [], 90)[0]:
    if s.recv(65536).split(b"\0")[0] == ("remove@" + devpath).encode():
        print("gone", flush=True)
        break
"""
CHECK = f"""
echo "sleepers=$(grep -l '^sleep' /proc/[0-9]*/comm 2>/dev/null | wc -l)"
echo "tmp=$(ls /tmp/gf-litter 2>/dev/null)"
echo "pins=$(ls /sys/fs/bpf)"
echo "events=$(cat /sys/kernel/tracing/uprobe_events)"
echo "edu=$({EDU})"
"""


def test_a_job_finds_nothing_of_the_last(vm_guest: Any, tmp_path: Path) -> None:
    g = vm_guest("bookworm")
    first = g.run(
        [sys.executable, "-c", LITTER, UNPLUG],
        cwd=REPO,
        rw=[tmp_path],
        qmp_on=[(UNPLUG, "device_del edu0")],
        timeout=120,
    )
    assert first.rc == 0 and "gone\n" in first.output, (first.error, first.output)
    assert first.fired == [UNPLUG]
    edu = next(ln for ln in first.output.splitlines() if ln.startswith("edu=/"))
    boots = g.boots
    second = g.run(["sh", "-c", CHECK], cwd=REPO, timeout=120)
    assert second.rc == 0, (second.error, second.output)
    assert g.boots == boots, "the same guest ran both jobs"
    out = second.output.splitlines()
    assert "sleepers=0" in out, out
    assert "tmp=" in out and "pins=" in out and "events=" in out, out
    assert edu in out, out  # put back by the Guest, at the same address
    assert not first.splats and not second.splats


def test_output_and_status_are_the_jobs_own(vm_guest: Any, tmp_path: Path) -> None:
    g = vm_guest("bookworm")
    a = g.run(["sh", "-c", f"echo one; echo written > {tmp_path}/f; exit 3"], rw=[tmp_path])
    b = g.run(["sh", "-c", "echo two"], cwd="/")
    assert (a.rc, a.output, b.rc, b.output) == (3, "one\n", 0, "two\n")
    assert (tmp_path / "f").read_text() == "written\n"


def test_a_job_past_its_timeout_takes_the_guest_down(vm_guest: Any) -> None:
    g = vm_guest("bookworm")
    res = g.run(["sleep", "600"], cwd="/", timeout=5)
    assert (res.rc, res.timed_out) == (vmrun.RC_TIMEOUT, True)
    assert not g.alive()
    boots = g.boots
    again = g.run(["true"], cwd="/", timeout=120)
    assert again.rc == 0 and g.boots == boots + 1


def test_rw_outside_the_shares_is_refused(vm_guest: Any) -> None:
    with pytest.raises(vmrun.VMError, match="not inside a share"):
        vm_guest("bookworm").run(["true"], cwd="/", rw=[str(REPO)])
