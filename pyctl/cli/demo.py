"""`gpufault demo`: one fault on the libcuda test double, end to end."""

from __future__ import annotations

import click

from pyctl.cli.base import user_errors
from pyctl.cli.options import db_option


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
    from pyctl import demo as demo_mod

    demo_mod.run(db_path, threads=threads, steps=steps)
