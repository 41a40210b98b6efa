"""gfpreload.so (LD_PRELOAD fault injection) against a libcuda TEST DOUBLE.

There is no GPU here: doubles/preload/libcuda_double.c is a stand-in for
libcuda.so.1 with the same names and prototypes that counts how often each
body ran, so a test can tell an injected (skipped) call from a forwarded
one. When the shared double pyctl/data/doubles/{libcuda.so.1,gf-infer} exists,
the shim is also run against that workload.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pyctl import paths

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "pyctl" / "hooks" / "preload"


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None or shutil.which("make") is None:
        pytest.skip("needs a C compiler and make (apt-get install gcc make)")
    d = tmp_path_factory.mktemp("gfpreload")
    subprocess.run(["make", "-s", "-C", str(SRC), f"OUT={d}"], check=True)
    return d


def run(
    out: Path, args: list[str], spec: str | None, tmp: Path, **env: str
) -> tuple[list[str], list[dict[str, object]], subprocess.CompletedProcess[str]]:
    log = tmp / f"inj-{len(list(tmp.iterdir()))}.jsonl"
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPUFAULT_")}
    e.update(env)
    e["LD_PRELOAD"] = str(out / "gfpreload.so")
    e["GPUFAULT_PRELOAD_LOG"] = str(log)
    if spec is not None:
        e["GPUFAULT_PRELOAD"] = spec
    p = subprocess.run(args, env=e, capture_output=True, text=True, timeout=60)
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return p.stdout.splitlines(), lines, p


def results(stdout: list[str], func: str) -> list[int]:
    return [int(x.split()[2]) for x in stdout if x.split()[0] == func]


def entered(stdout: list[str], func: str) -> int:
    (n,) = [int(x.split()[2]) for x in stdout if x.startswith(f"entered {func} ")]
    return n


def test_no_rules_passes_everything_through(out: Path, tmp_path: Path) -> None:
    so, log, p = run(out, [str(out / "double/gfp-app"), "direct", "5"], None, tmp_path)
    assert p.returncode == 0, p.stderr
    assert results(so, "cuMemAlloc_v2") == [0] * 5
    assert entered(so, "cuLaunchKernel") == 5
    assert log == []


def test_nth_and_every_by_exported_name(out: Path, tmp_path: Path) -> None:
    spec = "cuMemAlloc_v2:nth=3:ret=2;cuLaunchKernel:every=7:ret=719;cuCtxSynchronize:nth=1"
    so, log, p = run(out, [str(out / "double/gfp-app"), "direct", "21"], spec, tmp_path)
    assert p.returncode == 0, p.stderr
    alloc = results(so, "cuMemAlloc_v2")
    assert [i + 1 for i, r in enumerate(alloc) if r] == [3] and alloc[2] == 2
    launch = results(so, "cuLaunchKernel")
    assert [i + 1 for i, r in enumerate(launch) if r] == [7, 14, 21]
    assert set(launch) == {0, 719}
    assert results(so, "cuCtxSynchronize")[0] == 719  # default ret for sync calls
    # Skip mode: a failed call never entered the driver.
    assert entered(so, "cuMemAlloc_v2") == 20
    assert entered(so, "cuLaunchKernel") == 18
    assert entered(so, "cuStreamSynchronize") == 21  # no rule: untouched
    assert [(x["func"], x["call"], x["ret"]) for x in log if x["func"] != "cuCtxSynchronize"] == [
        ("cuMemAlloc_v2", 3, 2),
        ("cuLaunchKernel", 7, 719),
        ("cuLaunchKernel", 14, 719),
        ("cuLaunchKernel", 21, 719),
    ]
    assert all(x["pid"] == x["tid"] and x["via"] == "direct" for x in log)


def test_after_max_sticky(out: Path, tmp_path: Path) -> None:
    spec = (
        "cuMemAlloc_v2:after=4:max=3;cuStreamSynchronize:nth=2:sticky;"
        "cuGraphLaunch:nth=2:sticky:max=2"
    )
    so, log, p = run(out, [str(out / "double/gfp-app"), "direct", "10"], spec, tmp_path)
    assert p.returncode == 0, p.stderr
    fails = lambda f: [i + 1 for i, r in enumerate(results(so, f)) if r]  # noqa: E731
    assert fails("cuMemAlloc_v2") == [5, 6, 7]
    assert fails("cuStreamSynchronize") == list(range(2, 11))
    assert fails("cuGraphLaunch") == [2, 3]
    assert len(log) == 3 + 9 + 2


def test_cugetprocaddress_hands_back_the_shim(out: Path, tmp_path: Path) -> None:
    # "cuMemAlloc" at version 12000 is cuMemAlloc_v2; the per-thread-stream
    # flag gives cuLaunchKernel_ptsz: both must come back wrapped.
    spec = "cuMemAlloc_v2:nth=2;cuLaunchKernel:every=2"
    so, log, p = run(out, [str(out / "double/gfp-app"), "gpa", "4"], spec, tmp_path)
    assert p.returncode == 0, p.stderr
    assert results(so, "cuMemAlloc_v2") == [0, 2, 0, 0]
    assert results(so, "cuLaunchKernel") == [0, 719, 0, 719]
    assert entered(so, "cuLaunchKernel_ptsz") == 2
    assert entered(so, "cuMemAlloc_v2") == 3
    assert len(log) == 3


def test_dlopen_local_and_handle_dlsym(out: Path, tmp_path: Path) -> None:
    # The CUDA runtime's path: dlopen(RTLD_LOCAL) hides libcuda from the
    # global scope, so only the dlsym hook can interpose.
    lib = str(out / "double/libcuda.so.1")
    so, log, p = run(
        out, [str(out / "double/gfp-dlopen"), lib, "3"], "cuMemAlloc_v2:every=2", tmp_path
    )
    assert p.returncode == 0, p.stderr
    assert results(so, "cuMemAlloc_v2") == [0, 2, 0]  # calls 1-3 via cuGetProcAddress
    assert results(so, "handle-dlsym") == [2, 0, 2]  # calls 4-6, one shared counter
    assert entered(so, "cuMemAlloc_v2") == 3
    assert len(log) == 3


def test_dlsym_hook_can_be_turned_off(out: Path, tmp_path: Path) -> None:
    lib = str(out / "double/libcuda.so.1")
    so, log, p = run(
        out,
        [str(out / "double/gfp-dlopen"), lib, "3"],
        "cuMemAlloc_v2:every=2",
        tmp_path,
        GPUFAULT_PRELOAD_DLSYM="0",
    )
    assert p.returncode == 0, p.stderr
    assert entered(so, "cuMemAlloc_v2") == 6 and log == []


def test_threads_count_exactly(out: Path, tmp_path: Path) -> None:
    so, log, p = run(
        out,
        [str(out / "double/gfp-app"), "threads", "8", "700"],
        "cuLaunchKernel:every=7",
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    assert so[0] == "errors 800"
    assert entered(so, "cuLaunchKernel") == 5600 - 800
    assert len(log) == 800 and len({x["tid"] for x in log}) > 1
    assert sorted(int(x["call"]) for x in log) == list(range(7, 5601, 7))


def test_probability_is_seeded(out: Path, tmp_path: Path) -> None:
    app = [str(out / "double/gfp-app"), "direct", "2000"]
    spec = "cuLaunchKernel:prob=100000"
    a, _, _ = run(out, app, spec, tmp_path, GPUFAULT_PRELOAD_SEED="1")
    b, _, _ = run(out, app, spec, tmp_path, GPUFAULT_PRELOAD_SEED="1")
    c, _, _ = run(out, app, spec, tmp_path, GPUFAULT_PRELOAD_SEED="2")
    ra, rb, rc = (results(x, "cuLaunchKernel") for x in (a, b, c))
    assert ra == rb and ra != rc
    # 10 % of 2000: mean 200, sd about 13.
    assert 140 < sum(1 for r in ra if r) < 260


@pytest.mark.parametrize(
    "spec, word",
    [
        ("cuMemAlloc:nth=3", "unknown function"),
        ("cuMemAlloc_v2:nth=x", "bad number"),
        ("cuMemAlloc_v2:bogus=1", "unknown key"),
        ("cuMemAlloc_v2:prob=2000000", "parts per million"),
        ("cuMemAlloc_v2:nth=1;cuMemAlloc_v2:nth=2", "second rule"),
    ],
)
def test_bad_rules_stop_the_program(out: Path, tmp_path: Path, spec: str, word: str) -> None:
    so, log, p = run(out, [str(out / "double/gfp-app"), "direct", "1"], spec, tmp_path)
    assert p.returncode == 2
    assert so == [] and log == []
    assert word in p.stderr and p.stderr.count("\n") == 1
    assert not list(tmp_path.iterdir())  # no log file left behind


def test_shared_libcuda_double_workload(out: Path, tmp_path: Path) -> None:
    infer = paths.DOUBLE_INFER
    if paths.missing(infer, paths.DOUBLE_LIBCUDA):
        pytest.skip(paths.hint(infer))
    so, log, p = run(
        out,
        [str(infer), "--threads", "2", "--steps", "20"],
        "cuMemAlloc_v2:every=5:ret=2",
        tmp_path,
    )
    out_text = "\n".join(so)
    oom = re.findall(r"cuMemAlloc_v2 -> CUDA_ERROR_OUT_OF_MEMORY \(2\)", out_text)
    m = re.search(r"summary steps=\d+ errors=(\d+)", out_text)
    assert m, out_text[-500:]
    assert log and all(x["func"] == "cuMemAlloc_v2" for x in log)
    assert len(oom) == len(log) == int(m.group(1))
