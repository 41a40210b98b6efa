"""`gpufault hooks ...`: the in-process faults (VRAM pressure, Tensor Core
bit flips, the LD_PRELOAD shim).

The hooks live in `pyctl.hooks` and run as child processes in isolated
mode (pyctl.paths.module_argv: never from the working directory), so
`gpufault --help` never needs torch. Their options are declared here too,
so that `--help` lists them; the child parses them again.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from pyctl import paths
from pyctl.cli.options import DURATION


def _hooks_module(name: str, args: list[str]) -> int:
    # A child process: vram_pressure must own its signals and its CUDA context.
    # Isolated (-I): a ./pyctl or ./hooks in the working directory is never run.
    return subprocess.call(paths.module_argv(f"pyctl.hooks.{name}", args))


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
    type=click.Choice(["auto", "cupy", "torch"]),
    default="auto",
    show_default=True,
    help="who allocates the memory (auto: cupy, else torch)",
)
def vram_pressure(share: float, duration: float, device: int, allocator: str) -> None:
    """Hold a share of free VRAM in a separate process, checked with NVML.

    \b
    Example:
        gpufault hooks vram-pressure --share 0.5 --duration 30
    """
    sys.exit(
        _hooks_module(
            "vram_pressure",
            [
                "--share",
                str(share),
                "--duration",
                str(duration),
                "--device",
                str(device),
                "--allocator",
                allocator,
            ],
        )
    )


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
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def tc_measure(args: tuple[str, ...], **given: object) -> None:
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
    sys.exit(_hooks_module("tc_measure", [*argv, *args]))


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
    default=str(paths.PRELOAD_SHIM),
    show_default=True,
    help="The shim; make build puts it in pyctl/data/preload/.",
)
def preload_env(rules: str, log: str, so: str) -> None:
    """Print the environment that runs a program under the LD_PRELOAD shim.

    \b
    Example:
        eval "$(gpufault hooks preload-env 'cuMemAlloc_v2:nth=3:ret=2')" && ./app
    """
    if not Path(so).exists():
        raise click.ClickException(f"{so} is missing: build it with make build")
    # Let the shim itself validate the rules: one parser, one error text.
    chk = subprocess.run(
        ["/bin/true"],
        env={"LD_PRELOAD": so, "GPUFAULT_PRELOAD": rules},
        capture_output=True,
        text=True,
    )
    if chk.returncode != 0:
        raise click.ClickException(chk.stderr.strip())
    for k, v in (
        ("LD_PRELOAD", so),
        ("GPUFAULT_PRELOAD", rules),
        ("GPUFAULT_PRELOAD_LOG", str(Path(log).absolute())),
    ):
        click.echo(f"export {k}='{v}'")
