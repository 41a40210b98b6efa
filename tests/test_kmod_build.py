"""gpufa.ko builds out of tree without warnings (-Werror, W=1) against the
kernels whose headers are fetched (6.1, 6.12, 7.x: kmod/tests/kernels.py),
passes checkpatch, and its dkms.conf build command works."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

REPO = Path(__file__).resolve().parent.parent
KMOD = REPO / "kmod"
BUILD = REPO / "build"
sys.path.insert(0, str(KMOD / "tests"))
from kernels import KERNELS, Kernel  # noqa: E402

pytestmark = pytest.mark.slow

CHECKPATCH = BUILD / "kmod" / "checkpatch" / "checkpatch.pl"
PARAMS = {"devices", "bar0", "watchdog_ms", "fifo_records", "allow_reset"}


def kdir_or_skip(k: Kernel) -> Path:
    kdir = k.kdir()
    if kdir is None:
        pytest.skip(f"{k.name} kernel headers not fetched ({k.kdir_file}); run {k.fetch}")
    return kdir


def make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-C", str(KMOD), *args], capture_output=True, text=True)


def compiler_warnings(output: str) -> list[str]:
    """Compiler and linker diagnostics (file:line: warning:, cc1: error:), not
    notes from host tools such as pahole's version check."""
    pat = re.compile(r"(:\d+(:\d+)?: (warning|error):)|(^\S*(gcc|cc1|ld)\S*: (warning|error))")
    return [ln for ln in output.splitlines() if pat.search(ln)]


def modinfo(ko: Path) -> dict[str, list[str]]:
    with ko.open("rb") as f:
        sec = ELFFile(f).get_section_by_name(".modinfo")
        assert sec is not None, f"{ko} has no .modinfo"
        data = sec.data()
    out: dict[str, list[str]] = {}
    for item in data.split(b"\0"):
        if b"=" in item:
            k, v = item.decode().split("=", 1)
            out.setdefault(k, []).append(v)
    return out


@pytest.fixture(scope="module", params=list(KERNELS))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(kernel, kdir, output dir, make output) of a W=1 -Werror build."""
    k = KERNELS[request.param]
    kdir = kdir_or_skip(k)
    out = tmp_path_factory.mktemp(f"kmod-{k.name}")
    proc = make(f"KDIR={kdir}", f"OUT={out}", "W=1", *k.make_args, "tests")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return k, kdir, out, proc.stdout + proc.stderr


def test_builds_without_warnings(built) -> None:
    _, _, out, output = built
    assert (out / "gpufa.ko").is_file()
    assert (out / "tests" / "gpufa_fire_test.ko").is_file()
    assert compiler_warnings(output) == []
    # The source tree stays clean: everything went to OUT.
    assert not list(KMOD.glob("*.o")) and not list(KMOD.glob("*.ko"))


def test_werror_is_on(built) -> None:
    _, _, out, _ = built
    cmd = (out / ".gpufa.o.cmd").read_text()
    assert " -Werror " in cmd


def test_modinfo(built) -> None:
    _, kdir, out, _ = built
    info = modinfo(out / "gpufa.ko")
    assert info["license"] == ["GPL"]
    assert info["name"] == ["gpufa"]
    assert {p.split(":")[0] for p in info["parm"]} == PARAMS
    # Every parameter says what it does.
    assert all(len(p.split(":", 1)[1]) > 20 for p in info["parm"])
    release = kdir.name.removeprefix("linux-headers-")
    assert info["vermagic"][0].startswith(release + " ")
    # The test double needs gpufa for gpufa_fire().
    assert modinfo(out / "tests" / "gpufa_fire_test.ko")["depends"] == ["gpufa"]


def test_exports_gpufa_fire(built) -> None:
    _, _, out, _ = built
    symvers = (out / "Module.symvers").read_text()
    assert re.search(r"\tgpufa_fire\t\S+\tEXPORT_SYMBOL_GPL", symvers)


def test_checkpatch_clean() -> None:
    if not CHECKPATCH.exists():
        pytest.skip("checkpatch.pl not fetched (run python3 kmod/fetch_deps.py checkpatch)")
    proc = make("check")
    totals = re.findall(r"total: (\d+) errors, (\d+) warnings", proc.stdout)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert len(totals) == 5 and all(t == ("0", "0") for t in totals)


def test_dkms_conf_builds(tmp_path: Path) -> None:
    """Run dkms.conf's MAKE line the way dkms would: on a copy of the
    sources in its build dir, with kernel_source_dir set."""
    kdir = kdir_or_skip(KERNELS["6.1"])
    conf = dict(re.findall(r'^(\w+(?:\[\d+\])?)="(.*)"$', (KMOD / "dkms.conf").read_text(), re.M))
    assert conf["PACKAGE_NAME"] == "gpufa" and conf["BUILT_MODULE_NAME[0]"] == "gpufa"
    build = tmp_path / "dkms" / "gpufa" / conf["PACKAGE_VERSION"] / "build"
    shutil.copytree(KMOD, build, ignore=shutil.ignore_patterns("tests", "*.py"))
    cmd = (
        conf["MAKE[0]"]
        .replace("${kernel_source_dir}", str(kdir))
        .replace("${dkms_tree}", str(tmp_path / "dkms"))
        .replace("${PACKAGE_NAME}", "gpufa")
        .replace("${PACKAGE_VERSION}", conf["PACKAGE_VERSION"])
    )
    proc = subprocess.run(shlex.split(cmd), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (build / "gpufa.ko").is_file()
