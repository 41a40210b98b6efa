"""The libcuda TEST DOUBLE (doubles/libcuda_double.c) and the gf-infer
workload: built with make, run as real processes, inspected with binutils
and driven through ctypes in fresh processes (doubles/ctypes_probe.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyctl import catalog, paths

REPO = Path(__file__).resolve().parent.parent
OUT = paths.DOUBLES  # make build writes here; the wheel carries it
LIB = paths.DOUBLE_LIBCUDA
INFER = paths.DOUBLE_INFER
PROBE = REPO / "doubles" / "ctypes_probe.py"
ERR = re.compile(r"^step (\d+) tid (\d+): (\w+) -> (CUDA_\w+) \((\d+)\)$")
SUMMARY = re.compile(r"^summary steps=(\d+) errors=(\d+) mismatches=(\d+)$")


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not installed (apt-get install binutils make gcc)")
    return path


@pytest.fixture(scope="module")
def built() -> Path:
    _need("make")
    _need("cc")
    r = subprocess.run(
        ["make", "-s", "-C", str(REPO / "doubles"), f"OUT={OUT}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert LIB.is_file() and INFER.is_file()
    return OUT


def _infer(*args: str, env: dict[str, str] | None = None, timeout: int = 60):
    return subprocess.run(
        [str(INFER), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def _summary(stdout: str) -> tuple[int, int, int]:
    last = stdout.strip().splitlines()[-1]
    m = SUMMARY.match(last)
    assert m, last
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _probe(scenario: str, env: dict[str, str] | None = None) -> dict:
    r = subprocess.run(
        [sys.executable, str(PROBE), str(LIB), scenario],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# --- the library as a binary ---------------------------------------------------


def test_soname(built: Path) -> None:
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    with open(LIB, "rb") as f:
        elf = ELFFile(f)
        tags = [
            t.soname  # type: ignore[attr-defined]
            for s in elf.iter_sections()
            if isinstance(s, DynamicSection)
            for t in s.iter_tags()
            if t.entry.d_tag == "DT_SONAME"
        ]
    assert tags == ["libcuda.so.1"]


def _exported_functions() -> dict[str, int]:
    nm = _need("nm")
    out = subprocess.run(
        [nm, "-D", "--defined-only", str(LIB)], capture_output=True, text=True, check=True
    ).stdout
    syms = {}
    for line in out.splitlines():
        addr, kind, name = line.split()
        if kind in "Tt":
            syms[name] = int(addr, 16)
    return syms


def test_exports_every_catalogued_cuda_symbol(built: Path) -> None:
    exported = set(_exported_functions())
    wanted = set()
    for f in catalog.functions("cuda"):
        wanted |= {f.name, *f.aliases}
    assert wanted - exported == set()
    # and nothing the catalog does not describe (no helper leaks out)
    assert exported - wanted == set()


def test_every_export_starts_with_push_rbp(built: Path) -> None:
    objdump = _need("objdump")
    dis = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", str(LIB)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    first: dict[int, str] = {}
    for i, line in enumerate(dis):
        m = re.match(r"^([0-9a-f]+) <.+>:$", line)
        if m and i + 1 < len(dis):
            first[int(m.group(1), 16)] = dis[i + 1].split("\t", 1)[-1].strip()
    syms = _exported_functions()
    assert len(syms) > 90
    bad = {n: first.get(a) for n, a in syms.items() if not first.get(a, "").startswith("push")}
    assert bad == {}
    assert all(first[a].replace(" ", "") == "push%rbp" for a in syms.values())


def test_workload_links_the_double_by_soname_with_runpath(built: Path) -> None:
    readelf = _need("readelf")
    d = subprocess.run([readelf, "-d", str(INFER)], capture_output=True, text=True).stdout
    assert "Shared library: [libcuda.so.1]" in d
    # $ORIGIN: the double beside it, wherever the package is installed.
    assert "Library runpath: [$ORIGIN]" in d


# --- gf-infer ------------------------------------------------------------------


def test_workload_runs_clean(built: Path) -> None:
    r = _infer("--threads", "3", "--steps", "4", "--alloc-mib", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _summary(r.stdout) == (12, 0, 0)
    assert r.stdout.count("\n") == 1  # only the summary


def test_wait_then_maps_show_the_double(built: Path) -> None:
    p = subprocess.Popen(
        [str(INFER), "--wait", "--steps", "0", "--threads", "2", "--alloc-mib", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdin is not None
    try:
        line = p.stdout.readline()
        m = re.match(r"^ready pid=(\d+)$", line.strip())
        assert m, line
        assert int(m.group(1)) == p.pid
        maps = Path(f"/proc/{p.pid}/maps").read_text()
        assert str(LIB) in maps
        p.stdin.write("go\n")
        p.stdin.flush()
        p.stdin.close()  # --steps 0: run until stdin closes
        out = p.stdout.read()
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    steps, errors, mismatches = _summary(out)
    assert errors == 0 and mismatches == 0


def test_pool_exhaustion_is_out_of_memory(built: Path) -> None:
    r = _infer("--steps", "3", "--alloc-mib", "32", env={"GF_DOUBLE_MEM_MIB": "16"})
    assert r.returncode == 1
    lines = r.stdout.strip().splitlines()
    errs = [ERR.match(x) for x in lines[:-1]]
    assert all(errs), lines
    assert [(m.group(1), m.group(3), m.group(4), m.group(5)) for m in errs if m] == [
        (str(i), "cuMemAlloc_v2", "CUDA_ERROR_OUT_OF_MEMORY", "2") for i in (1, 2, 3)
    ]
    assert _summary(r.stdout) == (3, 3, 0)


def test_exit_on_error_stops_at_the_first(built: Path) -> None:
    r = _infer(
        "--steps", "5", "--alloc-mib", "32", "--exit-on-error", env={"GF_DOUBLE_MEM_MIB": "16"}
    )
    assert r.returncode == 1
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and ERR.match(lines[0])
    assert _summary(r.stdout)[1] == 1


def test_trap_makes_later_calls_fail_sticky(built: Path) -> None:
    r = _infer("--steps", "4", "--trap-at", "2", "--alloc-mib", "1")
    assert r.returncode == 1
    errs = [m for m in map(ERR.match, r.stdout.splitlines()) if m]
    # the trap launch itself succeeds; the failure surfaces at the next call
    # that looks at the context: the next launch or the synchronize
    assert errs[0].group(1) == "2" and errs[0].group(5) == "719"
    assert errs[0].group(3) in ("cuLaunchKernel", "cuStreamSynchronize")
    # ... and every later call fails the same way: the context is poisoned
    later = [m for m in errs if int(m.group(1)) > 2]
    assert later and all(m.group(4) == "CUDA_ERROR_LAUNCH_FAILED" for m in later)


@pytest.mark.parametrize(
    "args",
    [["--steps", "x"], ["--threads", "0"], ["--bogus"], ["--alloc-mib"]],
)
def test_bad_usage_is_one_line_and_exit_2(built: Path, args: list[str]) -> None:
    r = _infer(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_pool_size_is_reported(built: Path) -> None:
    r = _infer("--steps", "1", env={"GF_DOUBLE_MEM_MIB": "lots"})
    assert r.returncode == 1
    assert "GF_DOUBLE_MEM_MIB" in r.stderr
    assert r.stdout.startswith("setup: cuInit -> CUDA_ERROR_INVALID_VALUE (1)")


# --- the driver API through ctypes -----------------------------------------------


def test_calls_before_init_and_without_context(built: Path) -> None:
    assert _probe("uninit") == {
        "alloc_before_init": 3,  # CUDA_ERROR_NOT_INITIALIZED
        "init_bad_flags": 1,
        "init": 0,
        "alloc_no_ctx": 201,  # CUDA_ERROR_INVALID_CONTEXT
        "device_get_1": 101,  # CUDA_ERROR_INVALID_DEVICE
    }


def test_bad_pointers_give_invalid_value(built: Path) -> None:
    got = _probe("pointers")
    ok = {"alloc", "htod_ok", "dtoh_interior_ok", "free"}
    assert {k for k, v in got.items() if v == 0} == ok
    assert {k: v for k, v in got.items() if k not in ok} == {
        "alloc_zero": 1,
        "htod_unallocated": 1,
        "htod_null": 1,
        "htod_overrun": 1,
        "free_interior": 1,
        "dtoh_after_free": 1,
        "double_free": 1,
        "memset_unallocated": 1,
    }


def test_pool_runs_out_for_real_and_recovers(built: Path) -> None:
    got = _probe("pool", env={"GF_DOUBLE_MEM_MIB": "8"})
    assert got == {
        "a": 0,
        "b": 0,
        "c": 2,
        "free_mib": 0,
        "total_mib": 8,
        "free_a": 0,
        "c_again": 0,
        "too_big": 2,
    }


def test_illegal_address_is_sticky_until_the_context_is_destroyed(built: Path) -> None:
    assert _probe("sticky") == {
        "stream": 0,
        "getfunc": 0,
        "launch": 0,  # asynchronous: the fault is not known yet
        "sync": 700,  # CUDA_ERROR_ILLEGAL_ADDRESS
        "alloc_after": 700,
        "ctx_sync_after": 700,
        "destroy": 0,
        "alloc_destroyed_ctx": 709,  # CUDA_ERROR_CONTEXT_IS_DESTROYED
        "new_ctx": 0,
        "alloc_new_ctx": 0,
    }


def test_kernels_compute_and_modules_fail_like_the_driver(built: Path) -> None:
    got = _probe("kernels")
    assert got["first"] == got["last"] == 4 * 5  # fill 5, then y = 3*y + y
    assert (got["partial_255"], got["partial_256"]) == (1, 20)  # 1 block of 256
    assert got["getfunc_missing"] == 500  # CUDA_ERROR_NOT_FOUND
    assert got["getfunc_unsupported"] == 801  # in the PTX, not a built-in
    assert got["block_too_big"] == 1 and got["no_params"] == 1
    assert got["bad_func"] == 400  # CUDA_ERROR_INVALID_HANDLE
    assert got["load_elf"] == 209  # CUDA_ERROR_NO_BINARY_FOR_GPU
    assert got["load_garbage"] == 200  # CUDA_ERROR_INVALID_IMAGE


def test_streams_run_in_order_on_worker_threads(built: Path) -> None:
    got = _probe("streams")
    assert got["query_busy"] == 600 and got["event_query_busy"] == 600  # NOT_READY
    assert got["sync_s2"] == 0 and got["event_query_done"] == 0
    assert got["elapsed"] == 0 and got["elapsed_ms"] >= 300  # gf_sleep(300 ms)
    assert got["query_idle"] == 0 and got["destroy"] == 0
    assert got["sync_destroyed"] == 400


def test_graph_capture_launch_and_update(built: Path) -> None:
    assert _probe("graph") == {
        "begin": 0,
        "begin_again": 401,  # CUDA_ERROR_ILLEGAL_STATE
        "captured_launch": 0,
        "sync_while_capturing": 900,  # STREAM_CAPTURE_UNSUPPORTED
        "end": 0,
        "value_before_launch": 0,  # captured, not run
        "instantiate": 0,
        "launch": 0,
        "sync": 0,
        "value_after_launch": 9,
        "update_topology": 910,  # GRAPH_EXEC_UPDATE_FAILURE
        "update_result": 2,  # CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED
        "update_same": 0,
    }


def test_get_proc_address_resolves_like_cuda_h(built: Path) -> None:
    assert _probe("proc") == {
        "mem_alloc": 0,
        "mem_alloc_is_v2": 1,
        "status": 0,
        "ptsz": 0,
        "ptsz_is_ptsz": 1,
        "missing": 500,
        "missing_status": 1,  # CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
    }


def test_error_names_match_the_catalog(built: Path) -> None:
    got = _probe("errnames")
    want = {str(v): catalog.code_name("cuda", v) for v in range(1001)}
    assert got == want


def test_kernel_ptx_assembles_with_ptxas(built: Path, tmp_path: Path) -> None:
    ptxas = os.environ.get("GF_PTXAS") or shutil.which("ptxas")
    if ptxas is None and Path("/usr/local/cuda/bin/ptxas").is_file():
        ptxas = "/usr/local/cuda/bin/ptxas"
    if ptxas is None:
        pytest.skip("ptxas not found (CUDA toolkit or pip install nvidia-cuda-nvcc-cu12)")
    src = (REPO / "doubles" / "gf_infer.c").read_text()
    body = re.search(r"static const char ptx\[\] =\n(.*?);\n", src, re.S)
    assert body
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"', body.group(1))
    text = "".join(parts).encode().decode("unicode_escape")
    assert text.count(".entry") == 5
    (tmp_path / "k.ptx").write_text(text)
    for arch in ("sm_75", "sm_90"):
        r = subprocess.run(
            [ptxas, f"-arch={arch}", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr


@pytest.mark.root
def test_demo_binds_to_the_double_even_when_ld_library_path_names_another_libcuda(
    tmp_path: Path,
) -> None:
    """On a GPU host LD_LIBRARY_PATH names the real libcuda, and it wins
    over the workload's RUNPATH: the demo once probed the double while its
    workload called the real driver (0 calls traced). A copy of the double
    stands in for the other libcuda here."""
    if not paths.DOUBLE_LIBCUDA.exists():
        pytest.skip(paths.hint(paths.DOUBLE_LIBCUDA))
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(paths.DOUBLE_LIBCUDA, other / "libcuda.so.1")
    env = {**os.environ, "LD_LIBRARY_PATH": str(other)}
    r = subprocess.run(
        [sys.executable, "-m", "pyctl", "demo", "--db", str(tmp_path / "d.db")],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "1 fault(s) fired" in r.stdout, r.stdout[-2000:]
