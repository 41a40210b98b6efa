"""The new-machine path: what a newcomer runs first works with nothing
mounted but proc, sys and dev. CI runs on a machine that earlier runs may
have changed (tracefs mounted once hid a crash of `make demo` and 31 test
failures), so both checks build the new machine's state themselves:

- on the host, in a private mount namespace with tracefs and debugfs
  unmounted (the host's own mounts are untouched);
- in a VM whose init mounts nothing else (vmrun --bare), on Debian sid's
  kernel.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "fresh_machine.sh"
sys.path.insert(0, str(REPO / "vm"))

import vmrun  # noqa: E402

pytestmark = pytest.mark.root

UNMOUNT = (
    "for m in /sys/kernel/tracing /sys/kernel/debug/tracing /sys/kernel/debug "
    '/sys/fs/bpf; do umount -l $m 2>/dev/null; done; exec sh "$0"'
)


def _check(out: str) -> None:
    assert "FRESH-OK" in out, out[-4000:]
    assert "crc32 calls recorded: 100" in out
    assert "mounted tracefs" not in out  # the engine needs none
    assert "Traceback" not in out


def test_new_machine_path_on_the_host_without_tracefs(tmp_path: Path) -> None:
    r = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", UNMOUNT, str(SCRIPT)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**_env(), "TMPDIR": str(tmp_path)},
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    mounts = next(ln for ln in out.splitlines() if ln.startswith("== mounts:"))
    assert "/sys/kernel/tracing" not in mounts and "/sys/kernel/debug" not in mounts
    _check(out)


@pytest.mark.vm
@pytest.mark.slow
def test_new_machine_path_in_a_bare_vm() -> None:
    why = vmrun.kernel_available("sid")
    if why:
        pytest.skip(why)
    res = vmrun.run_in_vm("sid", ["sh", str(SCRIPT)], cwd=REPO, timeout=600, mem="2G", bare=True)
    assert res.rc == 0, res.output[-4000:]
    mounts = next(ln for ln in res.output.splitlines() if ln.startswith("== mounts:"))
    assert "/sys/kernel/tracing" not in mounts and "/sys/fs/bpf" not in mounts
    _check(res.output)
    assert not res.splats, res.splats


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
