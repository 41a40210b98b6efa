"""`gpufault hooks ...`: the in-process faults (VRAM pressure, Tensor Core
bit flips, the LD_PRELOAD shim).

The hooks live in `pyctl.hooks` and run as child processes in isolated
mode (pyctl.paths.module_argv: never from the working directory), so
`gpufault --help` never needs torch. Their options are declared here too,
so that `--help` lists them; the child parses them again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from pyctl import paths
from pyctl.cli.base import UserError, user_errors
from pyctl.cli.options import DURATION, db_option


def _hooks_module(name: str, args: list[str]) -> int:
    # A child process: vram_pressure must own its signals and its CUDA context.
    # Isolated (-I): a ./pyctl or ./hooks in the working directory is never run.
    return subprocess.call(paths.module_argv(f"pyctl.hooks.{name}", args))


@click.group(name="hooks")
def hooks_group() -> None:
    """In-process faults: VRAM pressure, Tensor Core bit flips, LD_PRELOAD shim."""


def _forwarding_signals(child: subprocess.Popen[Any]) -> None:
    """SIGTERM (and a SIGINT sent to us alone) goes to the child, which
    releases and says so; we keep reading until it has."""

    def forward(signo: int, _frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signo)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)


def _vram_child(args: list[str], db_path: str, spec: dict[str, Any]) -> int:
    """Run vram_pressure, echo its JSON lines, store the hold as a fault
    (pyctl/hooks/record.py); the store is opened only once it holds."""
    from pyctl.hooks.record import VramRun

    rec = VramRun(db_path, sys.argv, spec)
    child = subprocess.Popen(
        paths.module_argv("pyctl.hooks.vram_pressure", args), stdout=subprocess.PIPE, text=True
    )
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    _forwarding_signals(child)
    code = 1
    try:
        assert child.stdout is not None
        for line in child.stdout:
            click.echo(line, nl=False)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            rec.event(event)
        code = child.wait()
    finally:
        if child.poll() is None:  # we failed, not the child: it must not hold on
            child.terminate()
            code = child.wait()
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
        run_id = rec.end(code)
    if run_id:
        click.echo(f"run {run_id}: fault {run_id}-1 in {db_path}", err=True)
    return code


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
    spec = {"share": share, "duration": duration, "device": device, "allocator": allocator}
    sys.exit(
        _vram_child(
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
            db_path,
            spec,
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
    # Per-layer flip counts come back in a private file; stored once it ran.
    with tempfile.TemporaryDirectory(prefix="tc-measure-") as tmp:
        events = Path(tmp) / "events.jsonl"
        code = _hooks_module("tc_measure", [*argv, *args, "--gf-events", str(events)])
        if code == 0 and events.exists():
            from pyctl.hooks.record import record_tc

            spec = {k: v for k, v in given.items() if k != "as_json"}
            rows = [json.loads(x) for x in events.read_text().splitlines() if x]
            run_id, n = record_tc(db_path, sys.argv, spec, rows)
            click.echo(f"run {run_id}: {n} bit-flip faults (one per bit spec and layer)"
                       f" in {db_path}", err=True)
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
    _check_rules(rules, so)
    for k, v in (
        ("LD_PRELOAD", so),
        ("GPUFAULT_PRELOAD", rules),
        ("GPUFAULT_PRELOAD_LOG", str(Path(log).absolute())),
    ):
        click.echo(f"export {k}='{v}'")


def _check_rules(rules: str, so: str) -> None:
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


_SO_HELP = "The shim; make build puts it in pyctl/data/preload/."


@hooks_group.command(name="preload", context_settings={"ignore_unknown_options": True})
@click.argument("rules")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--so", "so", default=str(paths.PRELOAD_SHIM), show_default=True, help=_SO_HELP)
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
    from pyctl.hooks.record import import_preload

    _check_rules(rules, so)
    with tempfile.TemporaryDirectory(prefix="preload-log-") as tmp:
        log = Path(tmp) / "fires.jsonl"
        env = {**os.environ, "LD_PRELOAD": so, "GPUFAULT_PRELOAD": rules,
               "GPUFAULT_PRELOAD_LOG": str(log)}
        started = time.time()
        try:
            child = subprocess.Popen(list(command), env=env)
        except OSError as e:
            raise UserError(f"{command[0]}: {e.strerror}: pass a program that exists") from None
        try:
            code = child.wait()
        except KeyboardInterrupt:
            # The terminal's SIGINT reached the program too: wait for it,
            # then import what it logged.
            code = child.wait()
        run_id, n = import_preload(db_path, sys.argv, log, rules, exit_code=code,
                                   started=started)
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
    from pyctl.hooks.record import import_preload

    run_id, n = import_preload(db_path, sys.argv, Path(log), rules)
    click.echo(f"run {run_id}: {n} fault(s) from {log} in {db_path}")
