"""`gpufault hooks ...`: the in-process faults (VRAM pressure, Tensor Core
bit flips, the LD_PRELOAD shim).

The hooks live in `pyctl.hooks`, driven through pyctl/api/hooks.py, and run
as child processes in isolated mode (pyctl.paths.module_argv: never from the
working directory), so `gpufault --help` never needs torch. Their options are declared here too,
so that `--help` lists them; the child parses them again.
"""

from __future__ import annotations

import sys

import click

from pyctl.api import hooks as H
from pyctl.api.errors import GpufaultError
from pyctl.cli.base import user_errors
from pyctl.cli.options import DURATION, db_option


@click.group(name="hooks")
def hooks_group() -> None:
    """In-process faults: VRAM pressure, Tensor Core bit flips, LD_PRELOAD shim."""


@hooks_group.command(name="vram-pressure")
@click.option("--share", type=float, required=True, help="Share of FREE GPU memory, 0..1.")
@click.option(
    "--duration", type=DURATION, required=True, help="How long to hold it: 30s, 1m30s, 30."
)
@click.option("--device", type=int, default=0, show_default=True, help="CUDA device index")
@click.option(
    "--allocator",
    type=click.Choice(["auto", "cupy", "torch", "host-double"]),
    default="auto",
    show_default=True,
    help="who allocates the memory (auto: cupy, else torch; host-double: a test double"
    " in host memory, no GPU)",
)
@db_option()
@user_errors
def vram_pressure(share: float, duration: float, device: int, allocator: str, db_path: str) -> None:
    """Hold a share of free VRAM in a separate process, checked with NVML.

    \b
    Example:
        gpufault hooks vram-pressure --share 0.5 --duration 30
    """
    code, run_id = H.vram_pressure(
        db_path,
        share=share,
        duration=duration,
        device=device,
        allocator=allocator,
        argv=sys.argv,
        on_line=lambda line: click.echo(line, nl=False),
        forward_signals=True,
    )
    if run_id:
        click.echo(f"run {run_id}: fault {run_id}-1 in {db_path}", err=True)
    sys.exit(code)


# The options of pyctl/hooks/tc_measure.py's parser, for --help: only those
# given are passed on (its own defaults apply), and anything else after them
# goes to it untouched, so it, not click, refuses an option it lacks.
_TC_DTYPES = ["fp32", "bf16", "fp16"]
_TC_AS = ["fp16", "bf16", "fp32", "int8"]  # pyctl.hooks.bitflip.DTYPES (torch: not imported here)


@hooks_group.command(name="tc-measure", context_settings={"ignore_unknown_options": True})
@click.option("--model-dtype", type=click.Choice(_TC_DTYPES), help="the model's dtype [fp32]")
@click.option(
    "--as", "as_dtype", type=click.Choice(_TC_AS), help="flip bits as this dtype [the model's]"
)
@click.option("--rate", type=float, help="share of elements flipped per call [1e-3]")
@click.option("--seed", type=int, help="random seed [0]")
@click.option("--layers", help="fnmatch over nn.Linear names [*]")
@click.option("--matmul", is_flag=True, default=None, help="also attention matmul outputs")
@click.option("--device", help="torch device [cpu]")
@click.option("--bits", help="comma-separated bit specs [all]")
@click.option("--json", "as_json", is_flag=True, default=None, help="JSON instead of a table")
@db_option()
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@user_errors
def tc_measure(args: tuple[str, ...], db_path: str, **given: object) -> None:
    """Divergence per flipped bit on a tiny random transformer (table).

    \b
    Example:
        gpufault hooks tc-measure --model-dtype fp32 --as fp16 --rate 1e-3 --matmul
    """
    names = {"as_dtype": "--as", "as_json": "--json"}
    argv: list[str] = []
    for key, value in given.items():
        if value is None or value is False:
            continue
        flag = names.get(key, "--" + key.replace("_", "-"))
        argv += [flag] if value is True else [flag, str(value)]
    spec = {k: v for k, v in given.items() if k != "as_json"}
    code, run_id, n = H.tc_measure(db_path, [*argv, *args], spec, argv=sys.argv)
    if run_id:
        click.echo(
            f"run {run_id}: {n} bit-flip faults (one per bit spec and layer) in {db_path}", err=True
        )
    sys.exit(code)


@hooks_group.command(name="preload-env")
@click.argument("rules")
@click.option(
    "--log",
    "log",
    default="gfpreload.jsonl",
    show_default=True,
    help="where the shim writes one JSON line per fault",
)
@click.option(
    "--so",
    "so",
    default=str(H.PRELOAD_SHIM),
    show_default=True,
    help="The shim; make build puts it in pyctl/data/preload/.",
)
def preload_env(rules: str, log: str, so: str) -> None:
    """Print the environment that runs a program under the LD_PRELOAD shim.

    \b
    Example:
        eval "$(gpufault hooks preload-env 'cuMemAlloc_v2:nth=3:ret=2')" && ./app
    """
    try:
        env = H.preload_env(rules, log, so)
    except GpufaultError as e:
        raise click.ClickException(str(e)) from None
    for k, v in env.items():
        click.echo(f"export {k}='{v}'")


_SO_HELP = "The shim; make build puts it in pyctl/data/preload/."


@hooks_group.command(name="preload", context_settings={"ignore_unknown_options": True})
@click.argument("rules")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--so", "so", default=str(H.PRELOAD_SHIM), show_default=True, help=_SO_HELP)
@db_option()
@user_errors
def preload(rules: str, command: tuple[str, ...], so: str, db_path: str) -> None:
    """Run a program under the LD_PRELOAD shim; each fire becomes a fault.

    The shim's JSON lines go to a private file and are imported into the
    store when the program ends (also after Ctrl-C); exits with its status.

    \b
    Example:
        gpufault hooks preload 'cuMemAlloc_v2:nth=3:ret=2' -- python train.py
    """
    try:
        H.check_preload_rules(rules, so)
    except GpufaultError as e:
        raise click.ClickException(str(e)) from None
    code, run_id, n = H.preload(db_path, rules, command, so=so, argv=sys.argv)
    click.echo(f"run {run_id}: {n} fault(s) from the shim in {db_path}", err=True)
    sys.exit(code if code >= 0 else 128 - code)


@hooks_group.command(name="preload-import")
@click.argument("log", type=click.Path(exists=True, dir_okay=False))
@click.option("--rules", default="", help="the GPUFAULT_PRELOAD rules the program ran with")
@db_option()
@user_errors
def preload_import(log: str, rules: str, db_path: str) -> None:
    """Import a shim log (GPUFAULT_PRELOAD_LOG of preload-env) as a run.

    \b
    Example:
        gpufault hooks preload-import gfpreload.jsonl --rules 'cuMemAlloc_v2:nth=3:ret=2'
    """
    run_id, n = H.preload_import(db_path, log, rules, argv=sys.argv)
    click.echo(f"run {run_id}: {n} fault(s) from {log} in {db_path}")
