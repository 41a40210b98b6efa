"""pyctl.paths (where packaged artifacts live) and which libbpf is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pyctl import paths


def test_every_artifact_lives_inside_the_package() -> None:
    for p in (
        paths.DOUBLE_LIBCUDA,
        paths.DOUBLE_INFER,
        paths.PRELOAD_SHIM,
        paths.BUNDLED_LIBBPF,
        paths.BUNDLED_LIBELF,
        paths.bpf_object("gpufault"),
    ):
        assert p.is_relative_to(paths.DATA) and paths.DATA.parent == paths.PACKAGE
    assert "make build" in paths.hint(paths.DOUBLE_INFER)


def test_module_argv_is_isolated_and_only_for_pyctl() -> None:
    argv = paths.module_argv("pyctl.hooks.vram_pressure", ["--share", "0.5"])
    assert argv[:2] == [sys.executable, "-I"] and argv[-2:] == ["--share", "0.5"]
    assert str(paths.PACKAGE.parent) in argv
    with pytest.raises(ValueError):
        paths.module_argv("hooks.vram_pressure")


def _in_fresh_process(code: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_system_libbpf_first_where_the_loader_finds_one() -> None:
    code = "from pyctl.bpf import libbpf as L; print(*L.origin(), *L.version())"
    try:
        kind, path, major, _ = _in_fresh_process(code)
    except AssertionError as e:
        pytest.skip(f"no libbpf at all here: {e}")
    assert kind in ("system", "bundled")
    assert int(major) >= 1 and path.startswith("/")


@pytest.mark.skipif(
    bool(paths.missing(paths.BUNDLED_LIBBPF, paths.BUNDLED_LIBELF)),
    reason=paths.hint(paths.BUNDLED_LIBBPF),
)
def test_bundled_libbpf_loads_with_the_bundled_libelf() -> None:
    # As on a host without libbpf: only the bundled candidate is left.
    code = (
        "from pyctl.bpf import libbpf as L; o = L._candidates; "
        "L._candidates = lambda: [c for c in o() if c[0] == 'bundled']; "
        "print(*L.origin(), L.version()[0]); "
        "print(*sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libelf' in l}))"
    )
    kind, path, major, *elves = _in_fresh_process(code)
    assert (kind, path) == ("bundled", str(paths.BUNDLED_LIBBPF)) and int(major) >= 1
    assert elves == [str(paths.BUNDLED_LIBELF)]
