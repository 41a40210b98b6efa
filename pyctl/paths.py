"""Where the packaged artifacts live: one place for every caller.

`make build` writes the built binaries into the package (git-ignored), so
a checkout and an installed wheel look the same:

    pyctl/data/*.bpf.o                  CO-RE objects (bpf/*.bpf.c)
    pyctl/data/doubles/libcuda.so.1     libcuda TEST DOUBLE (doubles/, CPU only)
    pyctl/data/doubles/libcublas.so.13  libcublas TEST DOUBLE (a CPU SGEMM)
    pyctl/data/doubles/gf-infer         its inference-loop workload (RUNPATH $ORIGIN)
    pyctl/data/preload/gfpreload.so     LD_PRELOAD shim (pyctl/hooks/preload/)
    pyctl/data/lib/libbpf.so.1          Debian's libbpf + libelf, used only when
    pyctl/data/lib/libelf.so.1          the system has no libbpf.so.1
    pyctl/data/helper/gfsig.so          the signal fast path's in-target helper
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
# The evidence database a run writes by default (pyctl/evidence/store.py
# exports it): here so that what only names it imports no store.
DEFAULT_DB = Path("/var/lib/gpufault/gpufault.db")
DATA = PACKAGE / "data"
DOUBLES = DATA / "doubles"
PRELOAD = DATA / "preload"
LIB = DATA / "lib"

# The libcuda test double and its workload (not the CUDA driver).
DOUBLE_LIBCUDA = DOUBLES / "libcuda.so.1"
DOUBLE_LIBCUBLAS = DOUBLES / "libcublas.so.13"  # cuBLAS TEST DOUBLE (class 8 on CI)
DOUBLE_INFER = DOUBLES / "gf-infer"
PRELOAD_SHIM = PRELOAD / "gfpreload.so"
BUNDLED_LIBBPF = LIB / "libbpf.so.1"
BUNDLED_LIBELF = LIB / "libelf.so.1"
GFSIG = DATA / "helper" / "gfsig.so"  # pyctl/fastpath/gfsig.c (issue 26)


def bpf_object(name: str) -> Path:
    """pyctl/data/NAME.bpf.o (NAME without the suffix)."""
    return DATA / f"{name}.bpf.o"


def missing(*paths: Path) -> list[Path]:
    return [p for p in paths if not p.exists()]


def hint(path: Path) -> str:
    """One line for a missing artifact: what builds it."""
    return f"{path} missing: run `make build` in the checkout (or install the gpufault wheel)"


# Runs a module in isolated mode (-I: no cwd, no PYTHONPATH, no user site)
# with the directory that holds THIS pyctl first on sys.path, so a child
# imports the same package as its parent and never a planted ./pyctl,
# ./ctypes.py or a PYTHONPATH entry of the caller's (the child is root).
# die_with=PID: first ask the kernel for SIGTERM when the parent dies
# (PR_SET_PDEATHSIG), and check that the parent is still the one that
# started it (it may have died before the prctl). The one way gpufault
# starts a Python child: tests/test_child_isolation.py proves it for every
# command that starts one.
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); m = sys.argv.pop(1); p = int(sys.argv.pop(1))"
    "\nif p:"
    "\n import ctypes, os, signal"
    "\n ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)"
    "\n os.getppid() == p or sys.exit(143)"
    "\nimport runpy; runpy.run_module(m, run_name='__main__', alter_sys=True)"
)


def module_argv(
    module: str,
    args: list[str] | tuple[str, ...] = (),
    *,
    die_with: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """argv that runs `python -m MODULE ARGS` safely as a child (see _BOOT)."""
    if module != "pyctl" and not module.startswith("pyctl."):
        raise ValueError(f"{module}: only pyctl modules run this way")
    return [python, "-I", "-c", _BOOT, str(PACKAGE.parent), module, str(die_with or 0), *args]
