"""Shared fixtures and skip helpers. Tiers: unit (anyone), root (real BPF
on this kernel), vm (qemu/TCG). A skip always says why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build"

# Controllers started by tests put their control sockets here, not in the
# machine's /run/gpufault (inherited by every gpufault the tests start).
if "GPUFAULT_RUN_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _run_dir = tempfile.mkdtemp(prefix="gf-test-run-")
    os.environ["GPUFAULT_RUN_DIR"] = _run_dir
    atexit.register(shutil.rmtree, _run_dir, True)

# The symbol-table and capability cache (pyctl/diskcache.py) too: tests
# leave nothing in /var/cache/gpufault.
if "GPUFAULT_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="gf-test-run-cache-")
    os.environ["GPUFAULT_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, True)


def is_root() -> bool:
    return os.geteuid() == 0


requires_root = pytest.mark.skipif(not is_root(), reason="requires root (BPF, ptrace)")


@pytest.fixture
def tmp_db(tmp_path: Path) -> Path:
    return tmp_path / "gf.db"


# ---- the machine is left as it was found ------------------------------------
# A new machine has nothing mounted but proc, sys and dev; a test that mounts
# tracefs (or anything), adds a network namespace or a qdisc, and does not
# undo it would make the next run pass where a new machine fails (it did
# once: tracefs stayed mounted and CI hid a crash of `make demo`).


def _mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f}


def _netns() -> set[str]:
    try:
        return set(os.listdir("/run/netns"))
    except OSError:
        return set()


def _qdiscs() -> str:
    import subprocess

    try:
        r = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    # Qdiscs of network namespaces' devices are not listed here; the
    # default ones the kernel attaches itself are stable.
    return r.stdout


@pytest.fixture(autouse=True)
def _restores_signal_mask() -> object:
    """In-process CLI tests run the controller's set-up, which blocks
    SIGCHLD for the copilot: give the next test the mask this one had."""
    import signal

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.fixture(autouse=True)
def _leaves_no_mount_or_netns() -> object:
    mounts, netns = _mount_points(), _netns()
    yield
    left_m, left_n = _mount_points() - mounts, _netns() - netns
    assert not left_m, f"test left mounts behind: {sorted(left_m)}"
    assert not left_n, f"test left network namespaces behind: {sorted(left_n)}"


def _ours_outside_tmp() -> set[str]:
    """gpufault's own names in the shared places a test could litter:
    gf-prefixed entries of /tmp, /run and /dev/shm, the default evidence
    directory, the default control-socket directory's sockets."""
    out: set[str] = set()
    for d in ("/tmp", "/run", "/dev/shm"):
        try:
            # gf-test-run-*, gf-vm-*: a test session's socket dir and a VM
            # run's job dir (of this or another session running beside it),
            # each removed by its owner when it ends.
            out |= {
                f"{d}/{n}"
                for n in os.listdir(d)
                if n.startswith(("gf", "gpufault")) and not n.startswith(("gf-test-run-", "gf-vm-"))
            }
        except OSError:
            pass
    for p in ("/var/lib/gpufault", "/var/cache/gpufault"):
        if os.path.exists(p):
            out.add(p)
    try:
        out |= {f"/run/gpufault/{n}" for n in os.listdir("/run/gpufault")}
    except OSError:
        pass
    return out


# Settings a test could change for good (netchaos, the copilot).
_SYSCTLS = (
    "net/ipv4/ip_forward",
    "kernel/yama/ptrace_scope",
    "kernel/perf_event_paranoid",
    "kernel/unprivileged_bpf_disabled",
    "net/core/bpf_jit_enable",
)


def _sysctls() -> dict[str, str]:
    out = {}
    for k in _SYSCTLS:
        try:
            out[k] = Path("/proc/sys", k).read_text().strip()
        except OSError:
            pass
    return out


@pytest.fixture(scope="session", autouse=True)
def _leaves_no_qdisc_sysctl_or_file() -> object:
    before, files, sysctls = _qdiscs(), _ours_outside_tmp(), _sysctls()
    yield
    assert _qdiscs() == before, "the test session left qdiscs behind (tc qdisc show)"
    assert _sysctls() == sysctls, "the test session changed sysctls"
    left = _ours_outside_tmp() - files
    assert not left, f"the test session left files outside its temporary dirs: {sorted(left)}"


@pytest.fixture
def tracefs_mounted() -> object:
    """tracefs's path for a test that needs it (the engine does not): the
    one mounted already, else mounted here and unmounted afterwards."""
    import subprocess

    from pyctl import tracefs

    if not is_root():
        pytest.skip("requires root (tracefs)")
    tf = tracefs.find()
    if tf is not None:
        yield tf
        return
    subprocess.run(["mount", "-t", "tracefs", "nodev", tracefs.MOUNT_AT], check=True)
    try:
        yield tracefs.MOUNT_AT
    finally:
        subprocess.run(["umount", tracefs.MOUNT_AT], check=True)


@pytest.fixture
def evidence(tmp_path: Path) -> dict:
    """A database filled by tests/evidence_rows.py (no root): its ids, and
    its path as "db" (test_show_words.py, test_timeline.py)."""
    from evidence_rows import fill

    db = tmp_path / "gf.db"
    ids = fill(db)
    ids["db"] = str(db)
    return ids
