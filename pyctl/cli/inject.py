"""`gpufault inject` (arm one fault) and `gpufault release` (let go of the
threads a stall fault holds)."""

from __future__ import annotations

from typing import Any

import click

from pyctl.api.foreground import FaultSpec
from pyctl.api.values import SpecError, parse_int
from pyctl.cli.base import UserError, user_errors
from pyctl.cli.launch import RunCommand, split_run_params, start
from pyctl.cli.options import (
    CODE,
    DURATION,
    PROBABILITY,
    SIGNAL,
    BadValue,
    Duration,
    bundle,
    fault_target_options,
    no_stack_option,
    run_options,
    stack_copy_option,
)


# Each option's destination is its FaultSpec.from_fields field name, so the
# command hands its fault options over whole (split_run_params), not one by one.
def _counted_from_one(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """--nth/--every N: calls count from 1. A 0 given was taken as "not
    given", which fires on every call (80k faults in 40 s where one was
    meant): refused. Left out, the option is None (from_fields: 0)."""
    if value is None:
        return None

    what = max(param.opts, key=len)
    try:
        n = parse_int(value, what)
    except SpecError as e:
        raise BadValue(str(e), ctx=ctx, param=param) from None
    if n == 0:
        raise BadValue(
            f"{what} 0: calls count from 1, and 0 would fire on every matching call: "
            f"give N >= 1, or leave {what} out to fire on every call",
            ctx=ctx,
            param=param,
        )
    return value


trigger_options = bundle(
    click.option(
        "--nth", default=None, callback=_counted_from_one, help="fire on the Nth matching call only"
    ),
    click.option(
        "--every", default=None, callback=_counted_from_one, help="fire on every Nth matching call"
    ),
    click.option("--after", default="0", help="fire only after N matching calls"),
    click.option(
        "--prob", type=PROBABILITY, default=None, help="fire with this probability (5%, 0.05, ppm)"
    ),
    click.option("--max", default="0", help="fire at most K times"),
    click.option(
        "--sticky", is_flag=True, help="once fired, fail every call numbered after the first fire"
    ),
    click.option(
        "--caller",
        default=None,
        metavar="OBJ",
        help="only calls made from this object: main (the program), a library "
        "name (libtorch) or path; a libc function's internal calls then do not count",
    ),
    click.option(
        "--when",
        default=None,
        help="argument predicate, e.g. 'arg2>=200M' (== != < > <= >= &)",
    ),
    click.option(
        "--window",
        type=Duration(allow_zero=True),
        default=None,
        help="fire only from START after start until --duration, e.g. 5s",
    ),
)

action_options = bundle(
    click.option(
        "--action",
        type=click.Choice(["observe", "fail", "signal", "corrupt", "stall"]),
        default="fail",
        show_default=True,
        help="what a matching call gets (each takes its option below)",
    ),
    click.option(
        "--ret", type=CODE, default=None, help="fail: the return value, a number or a code name"
    ),
    click.option(
        "--mode",
        type=click.Choice(["skip", "after"]),
        default="skip",
        show_default=True,
        help="fail: skip the body, or run it and replace the return value",
    ),
    click.option(
        "--errno",
        default=None,
        metavar="ERRNO",
        help="fail: also set the thread's errno (EIO, 5), so the program's own "
        "strerror/perror says it; e.g. --ret -1 --errno EIO",
    ),
    click.option("--signal", type=SIGNAL, default=None, help="signal: SIGSEGV, SIGBUS, ..."),
    click.option(
        "--corrupt",
        default=None,
        help="corrupt: argN[+OFF][:zero|xor=M|set=V][:LEN], e.g. arg1:zero",
    ),
    click.option(
        "--stall", type=DURATION, default=None, help="stall: how long (20ms); omit for a hang"
    ),
    click.option("--trace", is_flag=True, help="also record every call"),
    no_stack_option,
    stack_copy_option,
)


@click.command(cls=RunCommand)
@fault_target_options
@action_options
@trigger_options
@run_options
@user_errors
def inject(**params: Any) -> None:
    """Inject a fault into a function of a running process (or a command).

    \b
    Examples:
      gpufault inject --pid 1234 --lib libcuda --fn cuMemAlloc_v2 \\
          --action fail --ret CUDA_ERROR_OUT_OF_MEMORY --nth 3
      gpufault inject --pid 1234 --lib libcuda --fn cuMemAlloc_v2 \\
          --action fail --ret 2 --when 'arg2>=200M' --after 2 --sticky
      gpufault inject --pid 1234 --lib libnccl --fn ncclAllReduce \\
          --action stall --stall 5ms --prob 5% --duration 30s
      gpufault inject --lib libgftarget --fn gf_alloc --action signal \\
          --signal SIGSEGV --nth 2 -- ./build/targets/gf_target
      gpufault inject --pid 1234 --lib libc --fn read --action fail --ret -1 \\
          --caller main --every 10      # only the program's own read() calls
    """
    fields, run = split_run_params(params)
    start("inject", [FaultSpec.from_fields(fields)], run)


@click.command()
@click.option(
    "--pid",
    "ctl_pid",
    type=int,
    default=None,
    help="the gpufault controller's pid (default: every running one)",
)
def release(ctl_pid: int | None) -> None:
    """Release threads held by a stall (hang) fault in running controllers.

    \b
    Example:
      gpufault release
    """
    # lazy: keeps pyctl.api.control (+1 module) off `--help`
    from pyctl.api.control import release as release_all

    # lazy: pyctl.api.errors (+2 modules) only when this runs
    from pyctl.api.errors import GpufaultError

    try:
        out = release_all(ctl_pid)
    except GpufaultError as e:
        raise UserError(str(e)) from None
    done, stale = out.released, out.stale
    if stale:
        click.echo(f"removed {stale} stale control socket(s) of controllers that died")
    for name, uid in out.untrusted:
        click.echo(
            f"gpufault: warning: {name} is served by uid {uid}, not root: sent nothing "
            "(stop that process; check who can write the run directory)",
            err=True,
        )
    if not done:
        who = (
            f"gpufault controller with pid {ctl_pid}" if ctl_pid else "running gpufault controller"
        )
        raise UserError(f"no {who} found: nothing to release")
    for r in done:
        click.echo(f"asked controller {r.pid} (run {r.run_id}) to release stalled threads")
