"""`gpufault demo` (`make demo`): the main job on an embedded default.

Starts the libcuda TEST DOUBLE's inference-loop workload (pyctl/data/
doubles/gf-infer, in the wheel too; a CPU stand-in with libcuda's soname
and exports, so this runs without a GPU) held before exec, arms
CUDA_ERROR_OUT_OF_MEMORY on its 3rd cuMemAlloc_v2 through the library
API, lets it run, and prints the fault's evidence chain.
"""

from __future__ import annotations

import os
import sys

import click

from pyctl import api
from pyctl.api import doubles
from pyctl.cli.base import user_errors
from pyctl.cli.options import db_option

WORKLOAD = doubles.DOUBLE_INFER
DOUBLE = doubles.DOUBLE_LIBCUDA
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


def run_demo(db_path: str, *, threads: int = 2, steps: int = 6) -> int:
    """Through the library, as a user's harness would: a Fault, a command
    Target, a session, its faults' evidence."""
    doubles.require(WORKLOAD, DOUBLE)
    spec = api.Fault.fail(str(DOUBLE), "cuMemAlloc_v2", ret="CUDA_ERROR_OUT_OF_MEMORY", nth=3,
                          trace=True)  # fmt: skip
    cmd = [str(WORKLOAD), "--threads", str(threads), "--steps", str(steps)]
    click.echo(f"demo: {' '.join(cmd)}  (libcuda test double, CPU only)", err=True)
    click.echo(f"demo: arming {spec.describe()}", err=True)
    # The workload must bind to the double: on a GPU host LD_LIBRARY_PATH
    # names the real libcuda, and LD_LIBRARY_PATH wins over the workload's
    # RUNPATH (gpufault demo from the wheel once traced 0 calls there). The
    # command inherits this environment (it is started inside arm());
    # gpufault's own is put back after.
    saved = os.environ.get("LD_LIBRARY_PATH")
    os.environ["LD_LIBRARY_PATH"] = str(DOUBLE.parent) + (f":{saved}" if saved else "")
    try:
        h = api.arm(spec, api.Target.run(cmd), db=db_path, kind="demo")
    finally:
        if saved is None:
            os.environ.pop("LD_LIBRARY_PATH", None)
        else:
            os.environ["LD_LIBRARY_PATH"] = saved
    click.echo(f"demo: run {h.run_id}, mechanism {h.mechanism}", err=True)
    with h:
        h.wait()  # the workload's exit ends the session; Ctrl-C disarms on the way out
    if h.error is not None:
        raise h.error
    rc = h.exit_code or 0
    faults = h.faults()
    calls = h.summary().calls
    click.echo(
        f"\ndemo: workload exited {rc}; {calls} cuMemAlloc_v2 calls traced, "
        f"{len(faults)} fault(s) fired\n"
    )
    for f in faults:
        click.echo(f.show())
        click.echo("")
    click.echo(
        f"Ask the database yourself: gpufault show {faults[0].fault_id if faults else '-'} "
        f"--db {db_path}   or   sqlite3 {db_path} 'select * from faults'"
    )
    if not faults:
        click.echo("demo: no fault fired (unexpected)", err=True)
        sys.exit(1)
    return rc


@click.command()
@db_option()
@click.option("--threads", default=2, show_default=True, help="workload threads")
@click.option("--steps", default=6, show_default=True, help="steps per thread")
@user_errors
def demo(db_path: str, threads: int, steps: int) -> None:
    """Inject OUT_OF_MEMORY into the 3rd cuMemAlloc_v2 of the libcuda double.

    Runs the CPU stand-in workload (pyctl/data/doubles/gf-infer, a test double
    of libcuda) under gpufault and prints the fault's evidence.

    \b
    Example:
      make demo
    """
    run_demo(db_path, threads=threads, steps=steps)
