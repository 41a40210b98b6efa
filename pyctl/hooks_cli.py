"""click commands for the in-process hooks and network chaos.

The lead registers them with `cli.add_command(hooks_group)` and
`cli.add_command(netchaos_group)`. The hooks live in `pyctl.hooks`, run
as child processes in isolated mode (pyctl.paths.module_argv: never from
the working directory), so `gpufault --help` never needs torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click

from pyctl import paths


def _hooks_module(name: str, args: list[str]) -> int:
    # A child process: vram_pressure must own its signals and its CUDA context.
    # Isolated (-I): a ./pyctl or ./hooks in the working directory is never run.
    return subprocess.call(paths.module_argv(f"pyctl.hooks.{name}", args))


@click.group(name="hooks")
def hooks_group() -> None:
    """In-process faults: VRAM pressure, Tensor Core bit flips, LD_PRELOAD shim."""


@hooks_group.command(name="vram-pressure")
@click.option("--share", type=float, required=True, help="Share of FREE GPU memory, 0..1.")
@click.option("--duration", type=float, required=True, help="Seconds to hold it.")
@click.option("--device", type=int, default=0, show_default=True)
@click.option("--allocator", type=click.Choice(["auto", "cupy", "torch"]), default="auto")
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


@hooks_group.command(name="tc-measure", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def tc_measure(args: tuple[str, ...]) -> None:
    """Divergence per flipped bit on a tiny random transformer (table).

    \b
    Example:
        gpufault hooks tc-measure --model-dtype fp32 --as fp16 --rate 1e-3 --matmul
    """
    sys.exit(_hooks_module("tc_measure", list(args)))


@hooks_group.command(name="preload-env")
@click.argument("rules")
@click.option("--log", "log", default="gfpreload.jsonl", show_default=True)
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


@click.group(name="netchaos")
def netchaos_group() -> None:
    """Delay, loss and partitions between two network namespaces (tc, BPF)."""


@netchaos_group.command(name="cleanup")
@click.option("--all", "all_owners", is_flag=True, help="Also namespaces of live owners.")
def netchaos_cleanup(all_owners: bool) -> None:
    """Remove gf* namespaces (and their veths) left by dead processes.

    \b
    Example:
        gpufault netchaos cleanup
    """
    from pyctl import netchaos

    if os.geteuid() != 0:
        raise click.ClickException("netchaos cleanup needs root: run it with sudo")
    for name in netchaos.cleanup(all_owners=all_owners):
        click.echo(f"removed {name}")
