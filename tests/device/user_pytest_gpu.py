"""A user's test, as docs/api.md shows one, run on the GPU machine (not
collected by this repository's suite: its name does not start with test_).
The `gpufault` fixture (the wheel's pytest11 plugin) arms a sticky
CUDA_ERROR_OUT_OF_MEMORY from the 4th cuMemAlloc_v2 of a torch process
and the test checks that torch raised OutOfMemoryError at that step and
that the evidence says so; the second test fails on purpose after arming,
and the third checks, in that test's torch process after its teardown,
that nothing is left armed: every allocation succeeds.

    cd REPO && python3 -m pytest -p no:cacheprovider tests/device/user_pytest_gpu.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

WORKLOAD = r"""
import json, sys, torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
print("READY", flush=True)
sys.stdin.readline()
held, out = [], {"raised_at_step": None}
for i in range(1, 9):
    try:
        held.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        out["raised_at_step"] = i
        break
print("RESULT " + json.dumps(out), flush=True)
"""


def _start() -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", WORKLOAD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    return p


@pytest.fixture
def torch_proc():
    p = _start()
    yield p
    p.kill()
    p.wait()


@pytest.fixture(scope="module")
def shared_proc():
    """One torch process for the last two tests: the second arms a sticky
    OOM into it and fails; the third allocates in it after that teardown."""
    p = _start()
    yield p
    p.kill()
    p.wait()


def result(p: subprocess.Popen) -> dict:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("go\n")
    p.stdin.flush()
    line = p.stdout.readline()
    assert line.startswith("RESULT "), line
    return json.loads(line[7:])


@pytest.mark.gpufault
def test_oom_from_the_4th_allocation(gpufault, torch_proc) -> None:
    spec = gpufault.Fault.fail("libcuda", "cuMemAlloc_v2", ret="CUDA_ERROR_OUT_OF_MEMORY",
                               after=3, sticky=True)  # fmt: skip
    h = gpufault.arm(spec, torch_proc.pid)
    assert result(torch_proc)["raised_at_step"] == 4
    (first, *_rest) = gpufault.assert_fired(h, function="cuMemAlloc_v2", code=2)
    assert first.call_seq == 4


@pytest.mark.gpufault
def test_a_failing_test_is_disarmed_at_teardown(gpufault, shared_proc) -> None:
    gpufault.arm(gpufault.Fault.fail("libcuda", "cuMemAlloc_v2", ret=2, sticky=True),
                 shared_proc.pid)  # fmt: skip
    raise AssertionError("this test fails on purpose, with its fault armed")


def test_nothing_is_left_armed(shared_proc) -> None:
    assert result(shared_proc)["raised_at_step"] is None  # all 8 allocations succeed
