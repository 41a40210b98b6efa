"""`make demo`: the main job on an embedded default.

Starts the libcuda TEST DOUBLE's inference-loop workload (pyctl/data/
doubles/gf-infer, in the wheel too; a CPU stand-in with libcuda's soname
and exports, so this runs without a GPU) held before exec, arms
CUDA_ERROR_OUT_OF_MEMORY on its 3rd cuMemAlloc_v2, lets it run, and prints
the fault's evidence chain.
"""

from __future__ import annotations

import os
import sys

import click

from pyctl import paths, query, store
from pyctl.engine import EngineError
from pyctl.run_options import RunOptions
from pyctl.runner import Runner, Target
from pyctl.spec import FaultSpec

WORKLOAD = paths.DOUBLE_INFER
DOUBLE = paths.DOUBLE_LIBCUDA
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


def run(db_path: str, *, threads: int = 2, steps: int = 6) -> int:
    for p in paths.missing(WORKLOAD, DOUBLE):
        raise EngineError(paths.hint(p))
    spec = FaultSpec(
        lib=str(DOUBLE),
        fn="cuMemAlloc_v2",
        action="fail",
        ret=OOM,
        ret_text="CUDA_ERROR_OUT_OF_MEMORY",
        nth=3,
        trace=True,
    ).validate()
    cmd = [str(WORKLOAD), "--threads", str(threads), "--steps", str(steps)]
    click.echo(f"demo: {' '.join(cmd)}  (libcuda test double, CPU only)", err=True)
    click.echo(f"demo: arming {spec.describe()}", err=True)
    opts = RunOptions(db_path=db_path, argv=("gpufault", "demo"), kind="demo", quiet=True)
    r = Runner([spec], Target(cmd=cmd), opts)
    # The workload must bind to the double: on a GPU host LD_LIBRARY_PATH
    # names the real libcuda, and LD_LIBRARY_PATH wins over the workload's
    # RUNPATH (gpufault demo from the wheel once traced 0 calls there). The
    # command inherits this environment; gpufault's own is put back after.
    saved = os.environ.get("LD_LIBRARY_PATH")
    os.environ["LD_LIBRARY_PATH"] = str(DOUBLE.parent) + (f":{saved}" if saved else "")
    try:
        eng = r.start()
    finally:
        if saved is None:
            os.environ.pop("LD_LIBRARY_PATH", None)
        else:
            os.environ["LD_LIBRARY_PATH"] = saved
    click.echo(f"demo: run {eng.run_id}, mechanism {eng.mechanism}", err=True)
    try:
        rc = r.loop()
    finally:
        r.finish(status="done", exit_code=None)
    db = store.open_db(db_path)
    rows = query.faults(db, run_id=eng.run_id)
    calls = db.conn.execute("SELECT count(*) FROM calls WHERE run_id=?", (eng.run_id,)).fetchone()[
        0
    ]
    click.echo(
        f"\ndemo: workload exited {rc}; {calls} cuMemAlloc_v2 calls traced, "
        f"{len(rows)} fault(s) fired\n"
    )
    for row in rows:
        doc = query.fault_chain(db, row["fault_id"])
        assert doc is not None
        click.echo(query.render_chain(doc))
        click.echo("")
    click.echo(
        f"Ask the database yourself: gpufault show {rows[0]['fault_id'] if rows else '-'} "
        f"--db {db_path}   or   sqlite3 {db_path} 'select * from faults'"
    )
    db.close()
    if not rows:
        click.echo("demo: no fault fired (unexpected)", err=True)
        sys.exit(1)
    return rc
