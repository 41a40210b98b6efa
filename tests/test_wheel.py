"""The wheel carries everything it needs.

Builds the wheel from a copy of this checkout, installs it into a NEW venv
(no system site packages; pip fetches click, prometheus-client, rust-demangler and, on 3.10,
tomli), then from a working directory outside the checkout runs
`gpufault doctor`, `gpufault demo` and a `gpufault trace` of libc in a
child started with `-- CMD`, and loads the wheel's bundled libbpf. Once
with this interpreter and once with Python 3.10 where one is installed.
Everything is written under the test's tmp directory (pip cache, TMPDIR,
databases); the checkout is only read.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from pyctl import __version__, paths

pytestmark = [pytest.mark.root, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = [
    paths.bpf_object("gpufault"),
    paths.DOUBLE_LIBCUDA,
    paths.DOUBLE_INFER,
    paths.PRELOAD_SHIM,
    paths.BUNDLED_LIBBPF,
    paths.BUNDLED_LIBELF,
]


def _setuptools_outputs() -> dict[str, int]:
    """What an in-place build writes in the checkout, with mtimes: the test
    builds from a copy, so none of it may change."""
    out = {}
    for pat in ("dist", "build/lib*", "build/bdist*", "*.egg-info", "*.egg-info/*"):
        for p in REPO.glob(pat):
            out[str(p.relative_to(REPO))] = p.stat().st_mtime_ns
    return out


def _py310() -> str | None:
    """A Python 3.10 that runs (a pyenv shim may name one it cannot run)."""
    cands = [shutil.which("python3.10"), "/usr/bin/python3.10"]
    cands += sorted(glob.glob("/root/.pyenv/versions/3.10*/bin/python3"), reverse=True)
    for c in filter(None, cands):
        try:
            r = subprocess.run(
                [c, "-c", "import sys, venv; print(sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except OSError:
            continue
        if r.returncode == 0 and r.stdout.strip() == "(3, 10)":
            return c
    return None


def _interpreters() -> list[Any]:
    out = [pytest.param(sys.executable, id=f"py{sys.version_info[0]}{sys.version_info[1]}")]
    py10 = _py310()
    if sys.version_info[:2] != (3, 10):
        out.append(
            pytest.param(
                py10,
                id="py310",
                marks=pytest.mark.skipif(py10 is None, reason="no Python 3.10 installed"),
            )
        )
    return out


def _env(tmp: Path, venv: Path | None = None) -> dict[str, str]:
    """A clean environment: nothing that points Python at the checkout."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "GPUFAULT_", "VIRTUAL_ENV", "PYENV_VERSION"))
    }
    env.update(TMPDIR=str(tmp), PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        env["VIRTUAL_ENV"] = str(venv)
    return env


def _run(
    cmd: list[str], tmp: Path, cwd: Path, venv: Path | None = None, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=cwd, env=_env(tmp, venv), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0:
        pytest.skip("requires root (BPF, ptrace)")
    missing = paths.missing(*ARTIFACTS)
    if missing:
        pytest.skip(paths.hint(missing[0]))
    try:
        import build  # noqa: F401
    except ImportError:
        pytest.skip("the `build` frontend is missing: pip install -e .[dev]")
    before = _setuptools_outputs()
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / f, src / f)
    shutil.copytree(REPO / "pyctl", src / "pyctl", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp / "dist"
    # --no-isolation with a setuptools that has bdist_wheel (>= 70.1): no
    # download; otherwise the isolated build fetches setuptools from PyPI.
    args = [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(src)]
    try:
        import setuptools.command.bdist_wheel  # noqa: F401

        args.insert(4, "--no-isolation")
    except ImportError:
        pass
    r = _run(args, tmp, cwd=tmp, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    assert _setuptools_outputs() == before
    return wheels[0]


def test_wheel_is_platform_tagged_and_carries_the_binaries(wheel: Path) -> None:
    assert wheel.name == f"gpufault-{__version__}-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        wheel_meta = z.read(f"gpufault-{__version__}.dist-info/WHEEL").decode()
        meta = z.read(f"gpufault-{__version__}.dist-info/METADATA").decode()
        entry_points = z.read(f"gpufault-{__version__}.dist-info/entry_points.txt").decode()
    for a in ARTIFACTS:
        rel = a.relative_to(paths.PACKAGE.parent).as_posix()
        assert rel in names, rel
    assert {"pyctl/data/regs_probe.bpf.o", "pyctl/data/xid.bpf.o"} <= names
    assert any(n.startswith("pyctl/templates/") and n.endswith(".toml") for n in names)
    assert "pyctl/hooks/vram_pressure.py" in names and "pyctl/hooks/tc_measure.py" in names
    # Executables stay executable; test doubles of the preload shim, C
    # sources and the checkout's other folders stay out.
    assert modes["pyctl/data/doubles/gf-infer"] & 0o111
    assert not [n for n in names if n.endswith(".c") or "/double/" in n or n.startswith("hooks/")]
    assert "Root-Is-Purelib: false" in wheel_meta
    assert "Requires-Python: >=3.10" in meta
    assert 'tomli>=1.1; python_version < "3.11"' in meta
    # The pytest plugin is found through its entry point, the Chaos Toolkit
    # extension by module name (docs/api.md).
    assert "[pytest11]\ngpufault = pyctl.pytest_plugin" in entry_points, entry_points
    assert {"pyctl/pytest_plugin.py", "pyctl/api/asserts.py"} <= names
    assert {f"pyctl/chaostoolkit/{m}.py" for m in ("__init__", "actions", "probes")} <= names


@pytest.mark.parametrize("python", _interpreters())
def test_installed_wheel_runs_outside_the_checkout(
    wheel: Path, python: str, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    r = _run([python, "-m", "venv", str(venv)], tmp_path, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    vpy = venv / "bin" / "python"
    r = _run(
        [str(vpy), "-m", "pip", "install", "-q", str(wheel)], tmp_path, cwd=tmp_path, venv=venv
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    gf = str(venv / "bin" / "gpufault")

    # Imported from the venv, not from the checkout.
    r = _run([str(vpy), "-c", "import pyctl, sys; print(pyctl.__file__)"], tmp_path, work, venv)
    pkg = Path(r.stdout.strip()).parent
    assert r.returncode == 0 and pkg.is_relative_to(venv), r.stdout + r.stderr

    r = _run([gf, "doctor"], tmp_path, work, venv, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"^ok\s+libbpf\s+libbpf (\d+)\.(\d+) \((system|bundled): (\S+)\)", r.stdout, re.M)
    assert m, r.stdout
    assert re.search(
        rf"^ok\s+bpf objects\s+{re.escape(str(pkg))}/data/gpufault\.bpf\.o$", r.stdout, re.M
    ), r.stdout

    # The bundled libbpf (and its libelf) load from the install where the
    # system has none: here the system has one, so ask for the copy.
    probe = (
        "from pyctl.bpf import libbpf as L; orig = L._candidates; "
        "L._candidates = lambda: [c for c in orig() if c[0] == 'bundled']; "
        "kind, path = L.origin(); print(kind, path, *L.version()); "
        "print([l.split()[-1] for l in open('/proc/self/maps') if 'libelf' in l][0])"
    )
    r = _run([str(vpy), "-c", probe], tmp_path, work, venv)
    assert r.returncode == 0, r.stderr
    first, elf = r.stdout.splitlines()
    kind, path, major, _minor = first.split()
    assert kind == "bundled" and Path(path) == pkg / "data/lib/libbpf.so.1" and int(major) >= 1
    assert Path(elf) == pkg / "data/lib/libelf.so.1"

    # The hooks are in the package (an installed wheel once failed with
    # ModuleNotFoundError: hooks): the real module answers, here without NVML.
    r = _run(
        [gf, "hooks", "vram-pressure", "--share", "0.5", "--duration", "1"], tmp_path, work, venv
    )
    assert "No module named" not in r.stderr and "vram_pressure:" in r.stderr, r.stderr
    r = _run([gf, "hooks", "preload-env", "cuMemAlloc_v2:nth=3:ret=2"], tmp_path, work, venv)
    assert r.returncode == 0, r.stderr
    assert f"export LD_PRELOAD='{pkg}/data/preload/gfpreload.so'" in r.stdout, r.stdout

    db = tmp_path / "x.db"
    r = _run([gf, "demo", "--db", str(db)], tmp_path, work, venv, timeout=180)
    out = r.stdout + r.stderr
    assert "fault(s) fired" in out and "CUDA_ERROR_OUT_OF_MEMORY" in out, out
    assert f"{pkg}/data/doubles/libcuda.so.1" in out, out
    assert re.search(r"[1-9]\d* fault\(s\) fired", out), out

    tdb = tmp_path / "t.db"
    r = _run(
        [
            gf,
            "trace",
            "--lib",
            "libc",
            "--fn",
            "getppid",
            "--db",
            str(tdb),
            "--",
            str(vpy),
            "-c",
            "import os; [os.getppid() for _ in range(7)]",
        ],
        tmp_path,
        work,
        venv,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"(\d+) matching calls, 0 fires, (\d+) events, 0 lost", r.stderr)
    assert m and int(m.group(1)) >= 7, r.stderr
    with sqlite3.connect(tdb) as c:
        assert c.execute("SELECT count(*) FROM calls").fetchone()[0] >= 7
    # Nothing was written in the working directory either.
    assert list(work.iterdir()) == []
