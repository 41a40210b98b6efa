"""Shared fixtures and skip helpers. Tiers: unit (anyone), root (real BPF
on this kernel), vm (qemu/TCG). A skip always says why."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build"

# ---- this session's id ------------------------------------------------------
# The machine is shared: another test session, a controller, a `gpufault
# serve` may run beside this one. Everything the session makes on the
# machine carries its id (tag("x") -> gf-t<id>-x; netchaos names its
# namespaces from GPUFAULT_TEST_ID too), and the leak checks below look only
# at names and paths that carry it. pytest_configure sets it: a fresh one per
# session (a pytest run by a test gets its own), and under pytest-xdist the
# controller's id plus the worker's number, so each worker checks its own.
ID_ENV = "GPUFAULT_TEST_ID"
_ID = ""
# Directories this session made at start and removes at exit (not leaks).
_OWN_DIRS: set[str] = set()


def tag(name: str = "") -> str:
    """A name for something this session makes on the machine (a netns, a
    directory in /tmp or /run): gf-t<id>-name."""
    return f"gf-t{_ID}-{name}"


def _own_dir(name: str) -> str:
    import atexit
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix=tag(name))
    _OWN_DIRS.add(d)
    atexit.register(shutil.rmtree, d, True)
    return d


def pytest_configure(config: pytest.Config) -> None:
    global _ID
    import secrets

    worker = getattr(config, "workerinput", None)
    if worker is not None and os.environ.get(ID_ENV):
        _ID = f"{os.environ[ID_ENV]}w{worker['workerid'].removeprefix('gw')}"
    else:
        _ID = secrets.token_hex(4)
    os.environ[ID_ENV] = _ID  # inherited by every process a test starts
    # Controllers started by tests put their control sockets here, not in
    # the machine's /run/gpufault (inherited by every gpufault the tests
    # start); the symbol-table and capability cache (pyctl/diskcache.py)
    # too: tests leave nothing in /var/cache/gpufault. xdist's workers
    # inherit the controller's.
    for var, name in (("GPUFAULT_RUN_DIR", "run-"), ("GPUFAULT_CACHE_DIR", "cache-")):
        if var not in os.environ:
            os.environ[var] = _own_dir(name)
    # Every native frame the tests stored is checked once the session ends
    # (issue 22; tests/frames_check.py, docs/tests.md). Loaded by path:
    # a session whose conftest is this file loaded from elsewhere (the
    # inner sessions of test_suite_isolation) has no tests/ on sys.path.
    frames_check = _sibling_module("frames_check")

    config.pluginmanager.register(frames_check.Plugin(), "gf-frames-check")


def _sibling_module(name: str):  # noqa: ANN202 (a module)
    """tests/NAME.py as the module NAME, the one already imported if any."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def is_root() -> bool:
    return os.geteuid() == 0


requires_root = pytest.mark.skipif(not is_root(), reason="requires root (BPF, ptrace)")


@pytest.fixture
def target() -> Iterator[object]:
    """A running build/targets/gf_target (tests/gftarget.py), closed after
    the test: the process most host tests probe."""
    from gftarget import Target

    t = Target()
    yield t
    t.close()


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


NETNS_DIR = "/run/netns"


def _netns() -> set[str]:
    try:
        return set(os.listdir(NETNS_DIR))
    except OSError:
        return set()


def _ours(name: str) -> bool:
    return name.startswith(tag())


def _our_mount(m: str, basetemp: str, mounted_tracefs: bool) -> bool:
    """Whether new mount point m is this session's: a netns of ours,
    /run/netns itself when nothing but ours is in it (netchaos unmounts
    it after the last of its namespaces when it made it), a path that
    carries the id or lies in the session's tmp_path base, tracefs at its
    place when no other session's tracefs_mounted holds it. Anything else
    (a mount of another process on this machine) is not this session's
    to judge: a mount carries no owner."""
    from pyctl import tracefs

    if m.startswith(NETNS_DIR + "/"):
        return _ours(os.path.basename(m))
    if m == NETNS_DIR:
        return all(_ours(n) for n in _netns())
    if f"/{tag()}" in m or m == basetemp or m.startswith(basetemp + "/"):
        return True
    if m == tracefs.MOUNT_AT:
        return mounted_tracefs or not _tracefs_holders()
    return False


def _tracefs_holders() -> list[str]:
    """Other sessions' tracefs_mounted markers (/run/gf-t<id>-tracefs)."""
    try:
        names = os.listdir("/run")
    except OSError:
        return []
    return [n for n in names if n.startswith("gf-t") and n.endswith("-tracefs") and not _ours(n)]


def _qdiscs() -> set[str]:
    """Root-namespace qdiscs on gf* devices: netchaos's veth ends live
    there between creation and their move into the link's namespaces; the
    rest (the machine's own devices) is not the suite's."""
    import subprocess

    try:
        r = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    # Qdiscs of network namespaces' devices are not listed here.
    return {ln for ln in r.stdout.splitlines() if " dev gf" in ln}


@pytest.fixture(autouse=True)
def _restores_signal_mask() -> object:
    """In-process CLI tests run the controller's set-up, which blocks
    SIGCHLD for the copilot: give the next test the mask this one had."""
    import signal

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


_TRACEFS_MOUNTED = [False]  # by this session's tracefs_mounted, now


@pytest.fixture(autouse=True)
def _leaves_no_mount_or_netns(tmp_path_factory: pytest.TempPathFactory) -> object:
    basetemp = str(tmp_path_factory.getbasetemp())
    mounts, netns = _mount_points(), _netns()
    yield
    new_m, new_n = _mount_points() - mounts, _netns() - netns
    left_m = {m for m in new_m if _our_mount(m, basetemp, _TRACEFS_MOUNTED[0])}
    left_n = {n for n in new_n if _ours(n)}
    problems = [f"test left mounts behind: {sorted(left_m)}"] if left_m else []
    if left_n:
        problems.append(f"test left network namespaces behind: {sorted(left_n)}")
    assert not problems, "; ".join(problems)


# The machine's gpufault places, which carry no id: a test should reach
# none of them (GPUFAULT_RUN_DIR and GPUFAULT_CACHE_DIR point elsewhere).
_DEFAULT_PLACES = ("/run/gpufault", "/var/lib/gpufault", "/var/cache/gpufault")


def _ours_outside_tmp() -> set[str]:
    """This session's names in the shared places a test could litter:
    entries of /tmp, /run and /dev/shm that carry its id, less the
    directories it removes itself at exit."""
    out: set[str] = set()
    for d in ("/tmp", "/run", "/dev/shm"):
        try:
            out |= {f"{d}/{n}" for n in os.listdir(d) if _ours(n)}
        except OSError:
            pass
    return out - _OWN_DIRS


def _default_places() -> set[str]:
    import glob

    # The experiment runner's ready-file directories (pyctl/experiment/runner.py).
    out = set(glob.glob("/tmp/gpufault-*")) | {p for p in _DEFAULT_PLACES if os.path.exists(p)}
    for p in _DEFAULT_PLACES:
        try:
            out |= {f"{p}/{n}" for n in os.listdir(p)}
        except OSError:
            pass
    return out


def session_pids() -> set[int]:
    """This process and its descendants, now."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [os.getpid()]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


def _held_by_session(path: str) -> bool:
    """Whether a process of this session holds path open, or listens on it
    (a unix socket: its inode in /proc/net/unix, then whose fd it is)."""
    inodes: set[str] = set()
    try:
        with open("/proc/net/unix") as f:
            for ln in f:
                parts = ln.split()
                if len(parts) >= 8 and parts[7] == path:
                    inodes.add(f"socket:[{parts[6]}]")
    except OSError:
        pass
    real = os.path.realpath(path)
    for pid in session_pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                t = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if t in inodes or t == real:
                return True
    return False


def bpf_prog_holders() -> dict[int, set[int]]:
    """BPF program id -> pids holding an fd of it or of a link to it (fdinfo)."""
    import re

    out: dict[int, set[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{d}/fdinfo")
        except OSError:
            continue
        for fd in fds:
            try:
                with open(f"/proc/{d}/fdinfo/{fd}") as f:
                    text = f.read()
            except OSError:
                continue
            for m in re.finditer(r"^prog_id:\s*(\d+)", text, re.M):
                out.setdefault(int(m.group(1)), set()).add(int(d))
    return out


def our_bpf_progs(named: Callable[[str], bool], unheld: bool = True) -> set[int]:
    """Ids of the loaded BPF programs with a name that `named` accepts that
    are this session's: held by one of its processes, or (unheld) by nobody:
    being freed after its holder exited, or leaked (pinned, attached without
    an fd); another's being freed is one of those for a moment, so an exact
    count of what a live test holds passes unheld=False. Those another
    gpufault on the machine holds (another session, a controller beside the
    suite) are not counted."""
    import json
    import subprocess

    out = subprocess.run(["bpftool", "prog", "show", "-j"], capture_output=True, text=True)
    ids = {int(p["id"]) for p in json.loads(out.stdout or "[]") if named(str(p.get("name", "")))}
    if not ids:
        return ids
    held, mine = bpf_prog_holders(), session_pids()
    return {i for i in ids if (unheld and not held.get(i)) or held.get(i, set()) & mine}


# Settings a test could change for good (netchaos, the copilot). They carry
# no name: this stays a before/after of the machine (no gpufault code writes
# them; a change is a bug of the suite or of something beside it).
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
    import warnings

    before, files, sysctls = _qdiscs(), _ours_outside_tmp(), _sysctls()
    places = _default_places()
    yield
    problems = []  # all of them at once: one run shows every leak
    if not _qdiscs() <= before:
        problems.append("the test session left qdiscs behind (tc qdisc show dev gf*)")
    if _sysctls() != sysctls:
        problems.append("the test session changed sysctls")
    left = _ours_outside_tmp() - files
    if left:
        problems.append(f"the test session left files outside its temporary dirs: {sorted(left)}")
    new = _default_places() - places
    held = sorted(p for p in new if _held_by_session(p))
    if held:
        problems.append(
            f"the test session's processes still hold gpufault's default places: {held}"
        )
    assert not problems, "; ".join(problems)
    if set(new) - set(held):
        # Another gpufault on this machine (a controller, `gpufault serve`)
        # makes these too, and a file does not say who made it.
        seen = sorted(new)
        warnings.warn(
            f"new in gpufault's default places (this session's or not): {seen}", stacklevel=1
        )


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
    # The marker tells another session's leak check that this mount is ours.
    marker = Path("/run", tag("tracefs"))
    marker.touch()
    subprocess.run(["mount", "-t", "tracefs", "nodev", tracefs.MOUNT_AT], check=True)
    _TRACEFS_MOUNTED[0] = True
    try:
        yield tracefs.MOUNT_AT
    finally:
        subprocess.run(["umount", tracefs.MOUNT_AT], check=True)
        _TRACEFS_MOUNTED[0] = False
        marker.unlink()


@pytest.fixture(scope="session")
def vm_guest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], object]]:
    """vm_guest(kernel): the session's booted guest of that kernel
    (vm/guest.py: edu device, 2 GiB), booted on first use and shared by the
    vm tests' jobs; each job gets a cleaned guest (fresh /tmp, its
    processes, trace events and modules gone), sees the session's pytest
    base directory read-write (a test's tmp_path), and a job that hangs or
    crashes the guest takes it down (the next one boots anew). Tests that
    need another machine (a bare init, other devices, a timeout of the
    runner itself) call vmrun.run_in_vm."""
    import sys

    sys.path.insert(0, str(REPO / "vm"))
    import vmrun
    from guest import Guest

    shares = vmrun._share_hidden_checkout(REPO, [str(tmp_path_factory.getbasetemp())])
    guests: dict[str, Guest] = {}

    def get(kernel: str) -> Guest:
        why = vmrun.kernel_available(kernel)
        if why:
            pytest.skip(why)
        if kernel not in guests:
            guests[kernel] = Guest(kernel, edu=True, rw=shares)
        return guests[kernel]

    yield get
    for g in guests.values():
        g.close()


@pytest.fixture
def evidence(tmp_path: Path) -> dict:
    """A database filled by tests/evidence_rows.py (no root): its ids, and
    its path as "db" (test_show_words.py, test_timeline.py)."""
    from evidence_rows import fill

    db = tmp_path / "gf.db"
    ids = fill(db)
    ids["db"] = str(db)
    return ids


# ---- in parallel (pytest-xdist: `make test` runs -n 2 --dist loadgroup) ------
# Tests go to whichever worker is free, one at a time (a file's tests may run
# on both: a module fixture is then made once per worker), except these
# groups, each run whole on one worker, one test after the other:
#  vm       every vm test: the session's shared guests (vm_guest) live in
#           one worker, and qemu/TCG takes a core per guest;
#  netns    /run/netns is mounted by the first namespace and unmounted only
#           by the process that mounted it, when its last goes: two
#           workers' links at once can leave it mounted;
#  tracefs  tracefs_mounted unmounts what it mounted, under the other
#           worker's test that found it mounted;
#  experiments  the runs of whole experiments: a service, open-loop load
#           and p99/recovery bounds of tens of ms each; two at once on two
#           cores broke each other's steady state (`-n 3`: a p99 of 99 ms
#           for a 50 ms bound before the method, a recovery 5.66 s for 5).
# (A whole file per worker was tried first: test_experiment_classes.py
# alone then took 22 minutes of one worker on the loaded machine.)
_NETNS_FILES = {
    "test_netchaos.py",
    "test_service_ranks.py",
    "test_layers_store.py",
    "test_hooks_cli.py",
    "test_suite_isolation.py",
}
_EXPERIMENT_FILES = {
    "test_experiment_classes.py",
    "test_experiment_run.py",
    "test_experiment_expect.py",
    "test_experiment_pressure.py",
    "test_observe_experiment.py",
    "test_chaostoolkit.py",
}
# Longest first (measured, GF_TEST_TIMES): the scheduler hands out work in
# this order, so no long test starts last while the other worker idles.
_FIRST = (
    "experiments",
    "vm",
    "netns",
    "test_experiment_class4_5.py",
)


def _group(item: pytest.Item) -> str | None:
    # vm before netns: a vm test of a netns file (netem in the guest) makes
    # its namespaces in the guest, and its guest is the vm worker's.
    if item.get_closest_marker("vm") is not None:
        return "vm"
    if item.path.name in _NETNS_FILES:
        return "netns"
    if item.path.name in _EXPERIMENT_FILES:
        return "experiments"
    if "tracefs_mounted" in getattr(item, "fixturenames", ()):
        return "tracefs"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A worker sees dist "no" and xdist's own loadgroup flag instead.
    if config.getoption("dist", "no") != "loadgroup" and not getattr(
        config.option, "loadgroup", False
    ):
        return
    for item in items:
        g = _group(item)
        if g is not None:
            item.add_marker(pytest.mark.xdist_group(g))

    def rank(item: pytest.Item) -> int:
        g = _group(item) or item.path.name
        return _FIRST.index(g) if g in _FIRST else len(_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order


# ---- where the time goes (GF_TEST_TIMES=FILE) --------------------------------
# One JSON line per test: its wall time (setup + call + teardown), the CPU
# seconds of this process and of its descendants meanwhile (qemu, a CLI, a
# service; reaped or still running), and the worker. CPU well below wall is waiting (a VM's
# guest under another's load, a sleep, a --duration window); near or above
# wall (two cores) is CPU-bound. docs/tests.md shows how to sum it.
_OUTCOMES: dict[str, str] = {}  # nodeid -> the first phase that did not pass


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome != "passed" and report.nodeid not in _OUTCOMES:
        _OUTCOMES[report.nodeid] = f"{report.outcome} in {report.when}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path = os.environ.get("GF_TEST_TIMES")
    if not path:
        yield
        return
    import json
    import resource
    import time

    tick = os.sysconf("SC_CLK_TCK")

    def live_children_cpu() -> float:
        """CPU of the descendants still running (a session's shared VM
        guest, a module's service): reaped ones are in RUSAGE_CHILDREN."""
        total = 0
        for pid in session_pids() - {os.getpid()}:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        return total / tick

    def cpu() -> tuple[float, float]:
        s, c = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime + live_children_cpu()

    t0, (s0, c0) = time.monotonic(), cpu()
    _OUTCOMES.pop(item.nodeid, None)
    yield
    wall, (s1, c1) = time.monotonic() - t0, cpu()
    row = {
        "id": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "wall": round(wall, 2),
        "cpu": round(s1 - s0, 2),
        "child_cpu": round(c1 - c0, 2),
        "vm": item.get_closest_marker("vm") is not None,
        "outcome": _OUTCOMES.pop(item.nodeid, "passed"),
    }
    with open(path, "a") as f:  # one short write per line: workers append safely
        f.write(json.dumps(row) + "\n")
