"""The kernel matrix: run tests/test_fail_matrix.py inside qemu (TCG) on
Debian sid's 7.2 kernel, where uprobe programs may write registers, and
require the regs mechanism there. (The host run of the same file requires
the copilot.) About 20-40 s under TCG."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "vm"))

import vmrun  # noqa: E402

pytestmark = [pytest.mark.vm, pytest.mark.root]


@pytest.mark.parametrize(
    "kernel, expect, multi", [("sid", "regs", "1"), ("bookworm", "copilot", "0")]
)
def test_fail_matrix_in_vm(kernel: str, expect: str, multi: str, vm_guest: Any) -> None:
    why = vmrun.kernel_available(kernel)
    if why:
        pytest.skip(why)
    # The session's guest of that kernel (conftest.vm_guest, 2 GiB).
    res = vm_guest(kernel).run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            # The guest's own tmpfs: SQLite's WAL needs shared mmap, which 9p lacks.
            "tests/test_fail_matrix.py",
            "tests/test_bpf_stack.py",
            "--basetemp",
            "/tmp/pytest-vm",
        ],
        cwd=REPO,
        env={"GF_EXPECT_MECH": expect, "GF_EXPECT_MULTI": multi},
        timeout=600,
    )
    assert res.rc == 0, res.output[-4000:]
    assert "passed" in res.output and "failed" not in res.output
    assert not res.splats, res.splats
