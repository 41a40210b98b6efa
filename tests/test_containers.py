"""Every fault kind on a containerised target (issue 28): real crun
containers and plain `unshare --pid --mount --fork` + chroot targets on a
root filesystem built from this host's files (tests/containers.py), real
BPF, real processes.

The container's libraries are copies at a path the host does not have
(/gf/lib): every library gpufault probes, unwinds or names there is
reached through the target's root (/proc/PID/root, /proc/PID/map_files).
Each test checks that the target kept running (but the one it kills) and
that no probe is left in its code afterwards."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import requires_root
from containers import (
    BIN,
    BUSYBOX,
    CRUN,
    LIBDIR,
    NSENTER,
    TARGETS,
    Contained,
    container,
    crun_state,
    leftovers,
    needed,
)
from gftarget import bpf_progs, no_new_progs

import gpufault
from gpufault import Fault

GF = [sys.executable, "-m", "pyctl"]
LIB = f"{LIBDIR}/libgftarget.so"  # the container's path of the library
HOST_LIB = str(TARGETS / "libgftarget.so")  # the host's build of the same file
KINDS = ["crun", "unshare"]


def _rows(db: Path, sql: str, *args: object) -> list[tuple]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql, args).fetchall()
    finally:
        con.close()


def _needs(kind: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("requires root (namespaces, BPF, ptrace)")
    for tool in (BUSYBOX, NSENTER):
        if not os.access(tool, os.X_OK):
            pytest.skip(f"{tool} is missing: apt-get install busybox-static util-linux "
                        "(tools/setup-deps.sh)")  # fmt: skip
    if kind == "crun" and not os.access(CRUN, os.X_OK):
        pytest.skip(f"crun is not installed ({CRUN}): apt-get install crun (tools/setup-deps.sh)")


@pytest.fixture(params=KINDS)
def box(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Contained]:
    """gf_target as the init of a container of each kind."""
    _needs(request.param)
    before = bpf_progs()
    with container(request.param, tmp_path) as c:
        yield c
    assert no_new_progs(before), "the test left gpufault programs loaded"


def code_at(c: Contained, fn: str = "gf_victim") -> tuple[str, str]:
    """The bytes at fn's probe site in the container's process, and in its
    file (the rootfs's copy): equal when no probe is in it."""
    from pyctl.symbols import resolve  # lazy: pyctl as the session imports it (conftest)

    sym = resolve.symbols(resolve.find_library(LIB, c.pid), fn)[0]
    addr = None
    with open(f"/proc/{c.pid}/maps") as f:
        for ln in f:
            p = ln.split()
            if len(p) >= 6 and p[5].endswith(LIB) and "x" in p[1]:
                addr = int(p[0].split("-")[0], 16) + sym.offset - int(p[2], 16)
    assert addr is not None, f"{LIB} is not mapped executable in pid {c.pid}"
    with open(f"/proc/{c.pid}/mem", "rb") as f:
        f.seek(addr)
        mem = f.read(8)
    with open(c.rootfs / LIB.lstrip("/"), "rb") as f:
        f.seek(sym.offset)
        disk = f.read(8)
    return mem.hex(), disk.hex()


def _probed(c: Contained) -> bool:
    mem, disk = code_at(c)
    return mem != disk and mem.startswith("cc")


def _untouched(c: Contained) -> None:
    """It runs on, its code is its file's again, its calls are its own."""
    assert c.alive()
    mem, disk = code_at(c)
    assert mem == disk, f"a probe is left at gf_victim: {mem} (file {disk})"
    assert [r[3] for r in c.victim(2)] == [2, 3]


# ---- the root filesystem itself ---------------------------------------------


@requires_root
def test_the_containers_libraries_are_its_own_copies(box: Contained) -> None:
    """The premise of the rest: the container maps files the host does not
    have at those paths (a probe by host path would miss them)."""
    maps = Path(f"/proc/{box.pid}/maps").read_text()
    # /proc/PID/maps names files from the reader's root: a crun container's
    # (in mounts of its own) by its path, a chroot's by the host's path.
    seen = "" if box.kind == "crun" else str(box.rootfs)
    assert f" {seen}{LIB}\n" in maps and f" {seen}{LIBDIR}/libc.so.6\n" in maps
    assert not os.path.exists(LIB) and not os.path.exists(f"{LIBDIR}/libc.so.6")
    mine = os.stat(box.rootfs / LIB.lstrip("/"))
    host = os.stat(HOST_LIB)
    assert (mine.st_dev, mine.st_ino) != (host.st_dev, host.st_ino)
    status = Path(f"/proc/{box.pid}/status").read_text()
    assert status.split("NSpid:")[1].split()[1] == "1"  # its own PID namespace's init


@requires_root
@pytest.mark.parametrize("kind", KINDS)
def test_a_failing_test_leaves_no_container_behind(kind: str, tmp_path: Path) -> None:
    """The fixture's own promise: a test that raises inside it still gets
    its container removed: processes, crun's state, cgroups."""
    _needs(kind)
    seen: list[tuple[int, str]] = []
    with pytest.raises(ZeroDivisionError), container(kind, tmp_path) as c:
        seen.append((c.pid, c.name))
        assert c.victim(1)
        1 / 0  # noqa: B018 - the failure a test would have
    ((pid, name),) = seen
    assert not Path(f"/proc/{pid}").exists()
    assert name == "" or leftovers(name) == []


# ---- every fault kind, on both kinds of container -----------------------------


@requires_root
@pytest.mark.parametrize("lib", ["libgftarget", LIB, HOST_LIB])
def test_fail_by_name_container_path_or_host_path(box: Contained, lib: str, tmp_path: Path) -> None:
    """fail: the 2nd call returns the injected value. The library named by
    its name, by the container's path, or by the host's path of the same
    build (matched by build-id to the copy the container maps); the fault
    stores the container's path, its stack names frames in the
    container's libc."""
    db = tmp_path / "gf.db"
    with gpufault.arm(Fault.fail(lib, "gf_victim", ret=-5, nth=2), box.pid, db=db,
                      duration=30) as s:  # fmt: skip
        assert _probed(box)
        assert [r[3] for r in box.victim(3)] == [2, -5, 4]
        assert s.wait_fires(1, 10)
        (f,) = s.faults()
    assert f.library == LIB and f.pid == box.pid and f.retval == -5
    frames = _rows(db, "SELECT symbol, module, method FROM stacks ORDER BY depth")
    assert frames[0][:2] == ("libgftarget.so!gf_victim+0x0", LIB), frames
    assert frames[1][0] == "gf_target!run_victim+0x9f" and frames[1][2] == "cfi", frames
    libc = [fr for fr in frames if fr[1] == f"{LIBDIR}/libc.so.6"]
    assert libc and all("!" in fr[0] for fr in libc), frames  # named: start_thread, clone3
    _untouched(box)


@requires_root
def test_fail_after_the_body_and_observe(box: Contained, tmp_path: Path) -> None:
    """fail --mode after (the body runs: its output is written, the value
    replaced) and observe (calls counted, nothing changed)."""
    db = tmp_path / "gf.db"
    spec = Fault.fail("libgftarget", "gf_victim", ret=-9, mode="after", nth=1)
    with gpufault.arm(spec, box.pid, db=db, duration=30) as s:
        rows = box.victim(2)
        assert s.wait_fires(1, 10)
    assert [(r[3], r[4]) for r in rows] == [(-9, 2), (3, 4)], rows
    # observe counts the matching calls in the kernel, changing nothing.
    with gpufault.arm(Fault.observe("libgftarget", "gf_victim"), box.pid, db=db,
                      duration=30) as s:  # fmt: skip
        rows = box.victim(3)
    assert [(r[3], r[4]) for r in rows] == [(2, 2), (3, 4), (4, 6)], rows
    assert (s.counters.calls, s.counters.fires, s.faults()) == (3, 0, [])
    _untouched(box)


@requires_root
def test_a_file_mounted_over_the_mapped_library_is_not_probed(
    box: Contained, tmp_path: Path
) -> None:
    """The container's root user mounts another file (its libc) over the
    library its process maps: the path now leads elsewhere, the mapping
    does not. gpufault probes the mapped file (through /proc/PID/map_files),
    not what the path leads to (there, no gf_victim at all)."""
    r = box.inside("mount", "--bind", f"{LIBDIR}/libc.so.6", LIB)
    assert r.returncode == 0, r.stderr
    seen = os.stat(f"/proc/{box.pid}/root{LIB}")
    libc = os.stat(box.rootfs / "gf/lib/libc.so.6")
    assert (seen.st_dev, seen.st_ino) == (libc.st_dev, libc.st_ino)  # the path is libc now
    db = tmp_path / "gf.db"
    for lib in (LIB, HOST_LIB):  # by the container's path and the host's: the same
        with gpufault.arm(Fault.fail(lib, "gf_victim", ret=-3, nth=1), box.pid, db=db,
                          duration=30) as s:  # fmt: skip
            assert [r[3] for r in box.victim(2)] == [-3, 3], lib
            assert s.wait_fires(1, 10)
            (f,) = s.faults()
        assert f.library == LIB
    with gpufault.arm(Fault.fail("libgftarget", "gf_victim", ret=-3, nth=1), box.pid, db=db,
                      duration=30) as s:  # fmt: skip
        assert [r[3] for r in box.victim(2)] == [-3, 3]
        assert s.wait_fires(1, 10)
        (f,) = s.faults()
    assert f.library == LIB
    # Its frames are unwound and named from the mapped file too.
    frames = _rows(db, "SELECT symbol, module, method FROM stacks WHERE fault_id = ? "
                       "ORDER BY depth", f.fault_id)  # fmt: skip
    want = [("libgftarget.so!gf_victim+0x0", LIB, "ip"),
            ("gf_target!run_victim+0x9f", f"{BIN}/gf_target", "cfi")]  # fmt: skip
    assert frames[:2] == want, frames
    assert box.inside("umount", LIB).returncode == 0
    _untouched(box)


@requires_root
@pytest.mark.parametrize("caller", ["main", f"{BIN}/gf_target", "libc"])
def test_caller_filter_by_the_containers_paths(box: Contained, caller: str, tmp_path: Path) -> None:
    """--caller: gf_victim is called from the program (main, its container
    path); never from libc, so that filter lets every call through."""
    with gpufault.arm(Fault.fail("libgftarget", "gf_victim", ret=-2, sticky=True, nth=1,
                                 caller=caller), box.pid, db=tmp_path / "gf.db",
                      duration=30) as s:  # fmt: skip
        rets = [r[3] for r in box.victim(2)]
        if caller != "libc":
            assert s.wait_fires(1, 10)
    assert rets == ([2, 3] if caller == "libc" else [-2, -2]), rets
    _untouched(box)


@requires_root
def test_trace_counts_the_calls_the_target_reports(box: Contained, tmp_path: Path) -> None:
    with gpufault.arm(Fault.trace("libgftarget", "gf_victim"), box.pid, db=tmp_path / "gf.db",
                      duration=30) as s:  # fmt: skip
        made = len(box.victim(7)) + len(box.victim(4, threads=2))
    (fn,) = s.summary().functions
    assert made == 15 and fn.calls == made and fn.returns == made, fn
    _untouched(box)


@requires_root
def test_cli_trace_by_host_pid(box: Contained, tmp_path: Path) -> None:
    """`gpufault trace --pid HOSTPID`: the calls it counts are the calls
    the target made; `probes` lists the container's file as mapped."""
    out = subprocess.run([*GF, "probes", "libgftarget", "--pid", str(box.pid)],
                         capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    assert out.startswith(f"{LIB} (mapped), "), out
    r, w = os.pipe()
    p = subprocess.Popen([*GF, "trace", "--pid", str(box.pid), "--lib", HOST_LIB, "--fn",
                          "gf_victim", "--db", str(tmp_path / "gf.db"), "--duration", "60s",
                          "-q", "--ready-fd", str(w)], pass_fds=(w,), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    os.close(w)
    with os.fdopen(r) as f:
        assert f.readline().startswith("ready"), p.communicate(timeout=60)
    made = len(box.victim(5)) + len(box.victim(3, threads=3))
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert made == 14 and re.search(r": 14 calls to 1 function", out), out
    (n,) = _rows(tmp_path / "gf.db", "SELECT count(*) FROM calls")[0]
    assert n == 14
    _untouched(box)


@requires_root
def test_stall_holds_the_call_for_its_time(box: Contained, tmp_path: Path) -> None:
    with gpufault.arm(Fault.stall("libgftarget", "gf_victim", stall="300ms", nth=1), box.pid,
                      db=tmp_path / "gf.db", duration=30) as s:  # fmt: skip
        t0 = time.monotonic()
        assert [r[3] for r in box.victim(1)] == [2]
        held = time.monotonic() - t0
        assert s.wait_fires(1, 10)
    assert 0.3 <= held < 5, held
    _untouched(box)


@requires_root
def test_hang_until_released(box: Contained, tmp_path: Path) -> None:
    got: list[list[int]] = []
    with gpufault.arm(Fault.hang("libgftarget", "gf_victim", nth=1), box.pid,
                      db=tmp_path / "gf.db", duration=60) as s:  # fmt: skip
        th = threading.Thread(target=lambda: got.append([r[3] for r in box.victim(1)]))
        th.start()
        assert s.wait_fires(1, 10)
        th.join(0.5)  # held: the call has not returned (a bounded look, not a sync)
        assert th.is_alive() and not got
        assert s.release() == 1
        th.join(10)
        assert got == [[2]]
    _untouched(box)


@requires_root
def test_corrupt_writes_through_the_argument(box: Contained, tmp_path: Path) -> None:
    with gpufault.arm(Fault.corrupt("libgftarget", "gf_victim", corrupt="arg2:zero", nth=2),
                      box.pid, db=tmp_path / "gf.db", duration=30) as s:  # fmt: skip
        rows = box.victim(3)
        assert s.wait_fires(1, 10)
    assert [(r[3], r[4]) for r in rows] == [(2, 2), (3, 0), (4, 6)], rows
    _untouched(box)


@requires_root
def test_sigsegv_kills_a_process_of_the_container(box: Contained, tmp_path: Path) -> None:
    """A second gf_target in the container (not its init: the kernel drops
    a signal without a handler to a PID namespace's init) dies of the
    injected SIGSEGV; the init runs on."""
    other = box.exec([f"{BIN}/gf_target"])
    try:
        with gpufault.arm(Fault.signal("libgftarget", "gf_victim", signal="SIGSEGV", nth=1),
                          other.pid, db=tmp_path / "gf.db", duration=30) as s:  # fmt: skip
            with pytest.raises(EOFError):
                other.victim(1)
            assert s.wait_fires(1, 10)
        assert other.p.wait(10) != 0
        assert not Path(f"/proc/{other.pid}").exists()
    finally:
        other.close()
    _untouched(box)


@requires_root
def test_sigsegv_into_a_containers_init_warns(box: Contained, tmp_path: Path) -> None:
    r, w = os.pipe()
    p = subprocess.Popen([*GF, "inject", "--pid", str(box.pid), "--lib", "libgftarget", "--fn",
                          "gf_victim", "--action", "signal", "--signal", "SIGSEGV", "--nth", "1",
                          "--db", str(tmp_path / "gf.db"), "--duration", "30s", "-q",
                          "--ready-fd", str(w)], pass_fds=(w,), stderr=subprocess.PIPE,
                         text=True)  # fmt: skip
    os.close(w)
    with os.fdopen(r) as f:
        assert f.readline().startswith("ready")
    # The fire is recorded; the kernel drops the signal: the init runs on.
    assert [r[3] for r in box.victim(1)] == [2]
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert _rows(tmp_path / "gf.db", "SELECT action FROM faults") == [("signal",)]
    want = (f"warning: pid {box.pid} is the init (pid 1) of its PID namespace and has no "
            "SIGSEGV handler: the kernel drops that signal "
            "(target another process of it)")  # fmt: skip
    assert [ln.strip() for ln in err.splitlines() if "init (pid 1)" in ln] == [want], err
    _untouched(box)


@requires_root
@pytest.mark.parametrize("kind", KINDS)
def test_tokenizer_lookup_reads_the_file_the_container_maps(kind: str, tmp_path: Path) -> None:
    """The tokenizer libraries of a process (tokenizers.libraries_of_pid,
    `tokenizer probes --target`): found by their names in its maps, read
    through its root; with another file mounted over that path, the mapped
    file itself. (A stand-in: a copy of libgftarget.so under the name of
    the tokenizers wheel's module, preloaded.)"""
    _needs(kind)
    from pyctl.symbols import tokenizers  # lazy: pyctl as the session imports it (conftest)

    tok = f"{LIBDIR}/tokenizers.abi3.so"
    with container(kind, tmp_path, env={"LD_PRELOAD": tok},
                   extra={tok: Path(HOST_LIB)}) as c:  # fmt: skip
        mine = os.stat(c.rootfs / tok.lstrip("/"))
        got = tokenizers.libraries_of_pid(c.pid)["tokenizers"]
        assert str(got) == f"/proc/{c.pid}/root{tok}"
        st = os.stat(got)
        assert (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
        assert c.inside("mount", "--bind", f"{LIBDIR}/libc.so.6", tok).returncode == 0
        got = tokenizers.libraries_of_pid(c.pid)["tokenizers"]
        assert str(got).startswith(f"/proc/{c.pid}/map_files/"), got
        st = os.stat(got)
        assert (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
        assert c.inside("umount", tok).returncode == 0


# ---- the workload with the libcuda double -------------------------------------


@requires_root
@pytest.mark.parametrize("kind", KINDS)
def test_libcuda_double_workload_in_a_container(kind: str, tmp_path: Path) -> None:
    """gf-infer on the libcuda TEST DOUBLE inside the container: its 3rd
    cuMemAlloc_v2 fails with CUDA_ERROR_OUT_OF_MEMORY and it says so; every
    cuLaunchKernel traced."""
    _needs(kind)
    before = bpf_progs()
    args = [f"{BIN}/gf-infer", "--wait", "--steps", "6", "--threads", "1"]
    with container(kind, tmp_path, args, ready="ready pid=1") as c:
        db = tmp_path / "gf.db"
        specs = [Fault.fail("libcuda", "cuMemAlloc_v2", ret="CUDA_ERROR_OUT_OF_MEMORY", nth=3),
                 Fault.trace("libcuda", "cuLaunchKernel")]  # fmt: skip
        with gpufault.arm(specs, c.pid, db=db, duration=30) as s:
            assert c.p.stdin is not None and c.p.stdout is not None
            c.p.stdin.write("go\n")
            c.p.stdin.flush()
            out = c.p.stdout.read()
            assert c.p.wait(10) == 1, out  # 1: a CUDA call failed
            assert s.wait_fires(1, 10)
            faults = s.faults()
        launches = {f.function: f.calls for f in s.summary().functions}["cuLaunchKernel"]
    assert [f.function for f in faults] == ["cuMemAlloc_v2"]
    assert faults[0].library == f"{LIBDIR}/libcuda.so.1"
    # The one fire recorded is the one failure the workload saw.
    assert out.splitlines() == ["step 3 tid 2: cuMemAlloc_v2 -> CUDA_ERROR_OUT_OF_MEMORY (2)",
                                "summary steps=6 errors=1 mismatches=0"], out  # fmt: skip
    assert launches == 5, out  # 6 steps, the one whose allocation failed launches nothing
    assert no_new_progs(before)


_PY_SCRIPT = """
import ctypes, sys
lib = ctypes.CDLL("/gf/lib/libgftarget.so")
lib.gf_victim.restype = ctypes.c_long
out = ctypes.c_long()


def inner(i):
    return lib.gf_victim(i, ctypes.byref(out))


def outer(n):
    return [inner(i) for i in range(1, n + 1)]


print("ready", flush=True)
for line in sys.stdin:
    if not line.strip().isdigit():
        break  # quit
    print(" ".join(map(str, outer(int(line)))), flush=True)
"""


@requires_root
@pytest.mark.parametrize("kind", KINDS)
def test_python_frames_of_a_python_process_in_a_container(kind: str, tmp_path: Path) -> None:
    """This interpreter's installation mounted at /py in the container (a
    path the host does not have), a script calling gf_victim by ctypes:
    the fault's Python frames are read through the container's root
    (libpython found in its maps, its symbols read from the mapped file,
    the thread found by its tid in the container's PID namespace)."""
    _needs(kind)
    prefix = Path(sys.base_prefix)
    if not (prefix / "bin" / "python3.11").exists() or sys.version_info[:2] != (3, 11):
        pytest.skip(f"needs this host's CPython 3.11 under {prefix}")
    script = tmp_path / "script.py"
    script.write_text(_PY_SCRIPT)
    libs = {f"{LIBDIR}/{n}": Path(p) for n, p in needed(prefix / "bin" / "python3.11")
            if not n.startswith("/") and not n.startswith("libpython")}  # fmt: skip
    ctypes_so = next((prefix / "lib/python3.11/lib-dynload").glob("_ctypes.cpython-*.so"))
    libs.update({f"{LIBDIR}/{n}": Path(p) for n, p in needed(ctypes_so) if not n.startswith("/")})
    with container(kind, tmp_path, ["/py/bin/python3.11", "-I", "-S", "/gf/script.py"],
                   env={"LD_LIBRARY_PATH": f"{LIBDIR}:/py/lib"},
                   extra={"/gf/script.py": script, **libs},
                   binds={"/py": str(prefix)}) as c:  # fmt: skip
        assert c.p.stdin is not None and c.p.stdout is not None
        db = tmp_path / "gf.db"
        # The copilot holds the thread while its Python frames are read; on
        # the signal path (the default) the call has returned by then.
        with gpufault.arm(Fault.fail("libgftarget", "gf_victim", ret=-4, nth=2), c.pid, db=db,
                          duration=30, mechanism="copilot") as s:  # fmt: skip
            c.p.stdin.write("3\n")
            c.p.stdin.flush()
            assert c.p.stdout.readline().split() == ["2", "-4", "4"]
            assert s.wait_fires(1, 10)
        py = _rows(db, "SELECT function, file FROM pyframes ORDER BY depth")
        assert py == [(f, "/gf/script.py") for f in ("inner", "outer.<locals>.<listcomp>",
                                                     "outer", "<module>")], py  # fmt: skip


# ---- naming the container: the library API and the CLI, crun's own state ------


@requires_root
def test_api_target_container_by_crun_name(tmp_path: Path) -> None:
    _needs("crun")
    before = bpf_progs()
    with container("crun", tmp_path) as c:
        assert crun_state(c.name)["status"] == "running"
        db = tmp_path / "gf.db"
        with gpufault.arm(Fault.fail("libgftarget", "gf_victim", ret=-7, nth=1),
                          gpufault.Target.container(c.name), db=db, duration=30) as s:  # fmt: skip
            assert s.target.pid == c.pid
            assert [r[3] for r in c.victim(2)] == [-7, 3]
            assert s.wait_fires(1, 10)
        (row,) = _rows(db, "SELECT host_pid, ns_pid, ns_tid, ns_depth, container_id, "
                           "container_name, runtime, selector, root FROM targets")  # fmt: skip
        assert row[:8] == (c.pid, 1, None, 1, c.name, c.name, "crun", f"container={c.name}"), row
        # Where the host finds its files: crun's own record of the rootfs.
        assert os.path.realpath(row[8]) == os.path.realpath(c.rootfs), (row, c.rootfs)
        _untouched(c)
        name = c.name
    assert leftovers(name) == []
    assert no_new_progs(before)


@requires_root
def test_cli_container_selects_the_crun_container(tmp_path: Path) -> None:
    _needs("crun")
    with container("crun", tmp_path) as c:
        db = tmp_path / "gf.db"
        r, w = os.pipe()
        p = subprocess.Popen([*GF, "inject", "--container", c.name, "--lib", HOST_LIB, "--fn",
                              "gf_victim", "--action", "fail", "--ret", "-6", "--nth", "1",
                              "--thread", "gf_target", "--db", str(db), "--duration", "60s",
                              "-q", "--ready-fd", str(w)], pass_fds=(w,),
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
        os.close(w)
        with os.fdopen(r) as f:
            line = f.readline()
        if not line.startswith("ready"):
            pytest.fail(f"not armed: {p.communicate(timeout=60)[1]}")
        # --thread: the main thread only; `both` calls on it, `victim` on a new one.
        (ln,) = c.cmd("both 1")
        assert ln.endswith("victim=-6"), ln
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        (row,) = _rows(db, "SELECT host_pid, host_tid, ns_pid, ns_tid, ns_depth, container_id, "
                           "container_name, runtime, selector FROM targets")  # fmt: skip
        assert row == (c.pid, c.pid, 1, 1, 1, c.name, c.name, "crun",
                       f"container={c.name}"), row  # fmt: skip
        shown = subprocess.run([*GF, "show", "latest", "--db", str(db)], capture_output=True,
                               text=True, timeout=60).stdout  # fmt: skip
        assert f"container {c.name} (crun" in shown and f"in {LIB}" in shown, shown
        assert "its files under " in shown and "on the host" in shown, shown
        _untouched(c)


@requires_root
def test_container_that_does_not_map_the_library_is_one_line(tmp_path: Path) -> None:
    _needs("crun")
    with container("crun", tmp_path) as c:
        r = subprocess.run([*GF, "inject", "--container", c.name, "--lib", "libnosuch", "--fn",
                            "x", "--action", "fail", "--ret", "-1", "--db",
                            str(tmp_path / "gf.db")], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "gf.db").exists()
        # A name crun does not run: one line naming the ones it does.
        r = subprocess.run([*GF, "inject", "--container", "gf-nosuch", "--lib", "libgftarget",
                            "--fn", "gf_victim", "--action", "fail", "--ret", "-1", "--db",
                            str(tmp_path / "gf.db")], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
        (line,) = r.stderr.strip().splitlines()
        assert r.returncode == 2 and "--container gf-nosuch: no such container" in line, line
        assert c.name in line, line
        assert not (tmp_path / "gf.db").exists()
        _untouched(c)


# ---- gpufault itself in a PID namespace -----------------------------------------


@requires_root
def test_doctor_says_what_a_gpufault_in_a_pid_namespace_needs(tmp_path: Path) -> None:
    host = subprocess.run([*GF, "doctor", "--json"], capture_output=True, text=True, timeout=120)
    assert '"name": "pid-namespace"' in host.stdout, host.stdout[-2000:]
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", *GF, "doctor"],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    out = r.stdout + r.stderr
    assert "pid-namespace" in out and "hostPID: true" in out and "--pid=host" in out, out
    assert r.returncode != 0
