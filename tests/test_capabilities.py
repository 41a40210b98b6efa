"""The trial loads behind `gpufault doctor` and the engine's choices, in the
real kernel (pyctl/bpf/features.py): the uprobe_multi trial's counting
program and its pid filter; the doctor's report (pyctl/api/doctor.py)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pyctl import capabilities
from pyctl.api import doctor
from pyctl.bpf import features
from pyctl.bpf.libbpf import BPF_TRACE_UPROBE_MULTI, BpfError, Object, map_lookup
from pyctl.symbols import resolve

pytestmark = [pytest.mark.root]


@pytest.fixture
def counter() -> Iterator[tuple[Object, str, int]]:
    """The trial's counting program, loaded as a uprobe_multi program."""
    libc = resolve.find_library("libc", os.getpid())
    (sym,) = resolve.symbols(libc, "getpid")[:1]
    obj = Object(capabilities.REGS_PROBE_OBJ)
    try:
        for p in ("gf_regs_probe", "gf_write_probe", "gf_multi_probe"):
            obj.set_autoload(p, p == "gf_multi_probe")
        obj.set_expected_attach_type("gf_multi_probe", BPF_TRACE_UPROBE_MULTI)
        try:
            obj.load()
        except BpfError as e:
            pytest.skip(f"no uprobe_multi programs here: {e}")
        yield obj, libc.path, sym.offset
    finally:
        obj.close()


def hits(obj: Object) -> int:
    v = ctypes.c_uint64(0)
    assert map_lookup(obj.map_fd("multi_hits"), ctypes.c_uint32(0), v)
    return v.value


def test_multi_link_counts_every_call_of_a_non_main_thread(counter) -> None:
    obj, path, off = counter
    obj.attach_uprobe_multi("gf_multi_probe", os.getpid(), path, [off], [0], False)
    getpid = ctypes.CDLL(None).getpid

    def five() -> None:
        for _ in range(5):
            getpid()

    t = threading.Thread(target=five)
    t.start()
    t.join()
    assert hits(obj) == 5


def test_multi_link_pid_filter_leaves_other_processes_alone(counter) -> None:
    obj, path, off = counter
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        obj.attach_uprobe_multi("gf_multi_probe", child.pid, path, [off], [0], False)
        for _ in range(5):
            ctypes.CDLL(None).getpid()  # ours: not the filtered process
        assert hits(obj) == 0
    finally:
        child.kill()
        child.wait()


def test_the_trial_site_is_libc_getpid_as_the_symbol_table_says() -> None:
    """bpf/ finds its probe site without the ELF reader above it: the
    loader's address of getpid, through /proc/self/maps, is the file offset
    pyctl.symbols reads from libc's symbol table."""
    site = features.getpid_site()
    assert site is not None
    libc = resolve.find_library("libc", os.getpid())
    (sym,) = resolve.symbols(libc, "getpid")[:1]
    assert os.path.realpath(site[0]) == os.path.realpath(libc.path)
    # resolve's offset may skip an endbr64 (4 bytes): the function's start is before it.
    assert sym.offset - site[1] in (0, 4), (site, sym.offset)


def test_capabilities_is_the_engines_view_of_the_trials() -> None:
    """The engine and the call counter ask pyctl.capabilities; the trials
    are bpf/'s, and capabilities imports nothing above bpf/."""
    assert capabilities.uprobe_multi is features.uprobe_multi
    assert capabilities.MAIN_OBJ == features.MAIN_OBJ
    import ast

    tree = ast.parse(Path(capabilities.__file__).read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert all(m in ("__future__",) or m.startswith("pyctl.bpf") for m in mods), mods


def test_multi_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    capabilities.uprobe_multi.cache_clear()
    monkeypatch.setenv("GPUFAULT_NO_UPROBE_MULTI", "1")
    try:
        assert capabilities.uprobe_multi() is False
    finally:
        capabilities.uprobe_multi.cache_clear()


def test_doctor_reports_the_link_kind() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pyctl", "doctor"], capture_output=True, text=True, timeout=120
    )
    (line,) = [x for x in r.stdout.splitlines() if "uprobe_multi links" in x]
    want = "one link per library" if capabilities.uprobe_multi() else "per-site links"
    assert line.startswith("ok") and want in line


def _doctor(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.run(
        [sys.executable, "-m", "pyctl", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_doctor_json_says_which_checks_each_feature_needs() -> None:
    r = _doctor("--json", "--for", "trace", "--for", "xids")
    doc = json.loads(r.stdout)
    assert set(doc["features"]) == {"trace", "xids"}
    by = {c["name"]: c for c in doc["checks"]}
    assert "xids" in by["nvidia xid tracepoint"]["required_for"]
    assert by["nvidia xid tracepoint"]["required"] is True
    assert by["tracefs"]["required"] is False  # the engine needs no tracefs
    assert "inject" in by["process tracepoints"]["required_for"]
    # This host has no NVIDIA driver: xids cannot run, and doctor says so.
    assert doc["ok"] is (
        by["nvidia xid tracepoint"]["ok"] and all(c["ok"] for c in doc["checks"] if c["required"])
    )
    assert r.returncode == (0 if doc["ok"] else 1)


def test_doctor_exits_1_only_when_the_requested_work_needs_a_failed_check() -> None:
    if doctor.nvidia_xid_tracepoint():
        pytest.skip("this host has the NVIDIA Xid tracepoint")
    ok = _doctor()  # trace + inject: all fine here
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "WARN nvidia xid tracepoint" in ok.stdout  # not needed: a warning
    bad = _doctor("--for", "xids")
    assert bad.returncode == 1
    assert "FAIL nvidia xid tracepoint" in bad.stdout
    assert bad.stderr.startswith("gpufault: nvidia xid tracepoint failed")


def test_doctor_as_non_root_fails_and_names_no_yama_fix_without_yama(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # In-process: this interpreter lives under /root, which another user
    # cannot read; what doctor decides only depends on the euid it sees.
    from click.testing import CliRunner

    from pyctl.cli import cli

    monkeypatch.setattr(doctor.os, "geteuid", lambda: 1000)
    r = CliRunner().invoke(cli, ["doctor"])
    assert r.exit_code == 1, r.output
    assert "FAIL root" in r.output and "euid 1000" in r.output
    if not os.path.exists("/proc/sys/kernel/yama/ptrace_scope"):
        assert "yama" not in r.output.lower()
    assert r.exception is None or isinstance(r.exception, SystemExit)
