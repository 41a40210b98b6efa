"""Value types and option bundles, defined once for every command group.

A value type (click.ParamType) reads one kind of value the same way in
every command, before the command body runs; a bad value is click's usage
error, which pyctl.cli.main prints as `gpufault: ...: see CMD --help`
(exit 2). The types call the library's parsers (pyctl/spec.py), so a
template file or an experiment file reads a value as the CLI does.

An option bundle (db_option, target_options, run_options, ...) is a
decorator that adds the same options with the same help everywhere, as
sqlite-utils does with its shared options.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import click

from pyctl.api import values as S

F = TypeVar("F", bound=Callable[..., Any])


class BadValue(click.BadParameter):
    """A bad value whose message already names the option (the library's
    messages do: `--duration: '0' must be longer than 0`): click's own
    `Invalid value for '--duration':` prefix would say it twice."""

    def format_message(self) -> str:
        return self.message


class _Type(click.ParamType):
    """Runs a pyctl.spec parser; its SpecError becomes a usage error."""

    def option_name(self, param: click.Parameter | None) -> str:
        """The name the user typed the value under: the long option."""
        if param is not None and getattr(param, "opts", None):
            return max(param.opts, key=len)
        return f"--{param.name.replace('_', '-')}" if param is not None and param.name else "value"

    def parse(self, value: Any, what: str) -> Any:
        raise NotImplementedError

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value  # a default already converted, or a second pass
        try:
            return self.parse(value, self.option_name(param))
        except S.SpecError as e:
            raise BadValue(str(e), ctx=ctx, param=param) from None


class Duration(_Type):
    """30s, 500ms, 1m30s, 2h, 1.5 (plain seconds) -> seconds (float).

    Zero is refused unless allow_zero: a zero --duration once meant 'no
    limit', a zero --stall a hang; both are spelled by omitting the option."""

    name = "DURATION"

    def __init__(self, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero

    def parse(self, value: str, what: str) -> float:
        return S.parse_duration(value, what, allow_zero=self.allow_zero)


class Size(_Type):
    """64M, 1GiB, 4096, 0x1000 -> bytes (int, K/M/G binary); not negative."""

    name = "SIZE"

    def parse(self, value: str, what: str) -> int:
        n = S.parse_int(value, what)
        if n < 0:
            raise S.SpecError(f"{what}: {value!r} is negative: give a size such as 64M or 1GiB")
        return n


class Probability(_Type):
    """5%, 0.05, 50000ppm -> a probability in (0, 1] (float)."""

    name = "PROBABILITY"

    def parse(self, value: str, what: str) -> float:
        return S.parse_prob(value) / 1_000_000


class Signal(_Type):
    """SIGUSR1, USR1, usr1, 10, SIGRTMIN+2 -> a signal number (int)."""

    name = "SIGNAL"

    def parse(self, value: str, what: str) -> int:
        return S.parse_signal(value, what)


class Code(_Type):
    """A return value: a number (2, -1, 0x10) or a code name from the catalogs
    (CUDA_ERROR_OUT_OF_MEMORY, oom) -> spec.ReturnCode. A name is looked up in
    the catalog of the fault's library when the spec is built
    (FaultSpec.from_fields), the one place code names are resolved."""

    name = "CODE"

    def parse(self, value: str, what: str) -> S.ReturnCode:
        return S.parse_code(value, what)

    def shell_complete(
        self, ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[click.shell_completion.CompletionItem]:
        # lazy: keeps pyctl.cli.completion (+2 modules) off trace's start and `trace --help`
        from pyctl.cli.completion import code_names

        return code_names(ctx, param, incomplete)


class Since(_Type):
    """10m, 2h (that long ago) or an ISO time (2026-12-01T11:00, local time
    unless it names a zone) -> Unix time (float): `faults --since`."""

    name = "SINCE"

    def parse(self, value: str, what: str) -> float:
        try:
            return time.time() - S.parse_duration(value, what, allow_zero=True)
        except S.SpecError:
            pass
        try:
            return dt.datetime.fromisoformat(value.strip()).timestamp()
        except ValueError:
            raise S.SpecError(
                f"{what}: {value!r} is neither a duration (10m, 2h) nor an ISO time "
                "(2026-12-01T11:00:00)"
            ) from None


DURATION = Duration()
SINCE = Since()
SIZE = Size()
PROBABILITY = Probability()
SIGNAL = Signal()
CODE = Code()


# ---- --db: one option, one meaning ------------------------------------------


def db_from(ctx: click.Context | None, given: str | None, *, default: bool = True) -> str | None:
    """The database a command uses: its own --db (kept for old command
    lines), else the root group's --db / GPUFAULT_DB (ctx.obj), else
    GPUFAULT_DB when the group runs alone (a test's CliRunner), else the
    default path, or None when `default` is False (anchors watch stores
    only when asked)."""
    if given:
        return given
    obj = ctx.find_object(Settings) if ctx is not None else None
    if obj is not None and obj.db:
        return obj.db
    env = os.environ.get("GPUFAULT_DB")
    if env:
        return env
    return str(S.DEFAULT_DB) if default else None


class Settings:
    """The root group's options, in ctx.obj for every command below it."""

    def __init__(self, db: str | None = None) -> None:
        self.db = db


def db_option(*, default: bool = True, path_type: type | None = None) -> Callable[[F], F]:
    """`--db PATH` on a command: the same database as `gpufault --db PATH CMD`.

    The command receives `db_path` already resolved (db_from). With
    default=False it is None unless a --db or GPUFAULT_DB names one."""

    def resolve(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        if ctx.resilient_parsing:
            return value  # shell completion: only what the line says (completion._db_for)
        db = db_from(ctx, value, default=default)
        return path_type(db) if (db is not None and path_type is not None) else db

    return click.option(
        "--db",
        "db_path",
        type=click.Path(dir_okay=False),
        default=None,
        callback=resolve,
        help=f"evidence database (default: gpufault --db, GPUFAULT_DB, or {S.DEFAULT_DB})"
        if default
        else "also store the records in this database (or gpufault --db / GPUFAULT_DB)",
    )


# ---- bundles ------------------------------------------------------------------


def bundle(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    """Apply decorators in the order written (top one outermost), as if each
    were written above the function."""

    def apply(fn: F) -> F:
        for d in reversed(decorators):
            fn = d(fn)
        return fn

    return apply


def target_options(fn: F) -> F:
    """-p/--pid and --tid: a running process, or one of its threads; or a
    selector of processes by where they run (docs/containers.md)."""
    return bundle(
        click.option("-p", "--pid", type=int, help="a running process (all of its threads)"),
        click.option("--tid", type=int, help="only this thread (its process is the target)"),
        click.option("--container", metavar="NAME|ID",
                     help="every process of a container (crun, runc, containerd, Docker, "
                     "CRI-O, Podman) that maps the library"),
        click.option("--cgroup", metavar="PATH",
                     help="every process in this cgroup or below it that maps the library"),
        click.option("--pod", metavar="NS/NAME[/CONTAINER]",
                     help="every process of a Kubernetes pod on this node that maps the library"),
        click.option("--comm", metavar="NAME",
                     help="every process of this name (a glob matches several)"),
        click.option("--ranks-of", "ranks_of", type=int, metavar="PID",
                     help="the ranks of a job: PID and its descendants that map the library, "
                     "each tagged with its rank"),
        click.option("--thread", "thread_name", metavar="NAME",
                     help="only the threads of this name (of --pid or the selection)"),
    )(fn)  # fmt: skip


def duration_option(*, help: str, required: bool = False, default: Any = None) -> Callable[[F], F]:
    """--duration in the one spelling (Duration): 30s, 500ms, 1m30s, 2h, 1.5."""
    return click.option("--duration", type=DURATION, default=default, required=required, help=help)


# click.option(...) makes a new Option each time it decorates: one bundle
# serves every command.
quiet_option = click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="print only warnings and errors (the closing line when records were lost "
    "or dropped); no start-up lines: wait for --ready-fd instead",
)


def _ready_fd(_ctx: click.Context, _param: click.Parameter, value: int | None) -> int | None:
    if value is None:
        return None
    if value < 3:
        raise click.BadParameter("give a descriptor of 3 or more (0-2 are stdin, stdout, stderr)")
    try:
        os.fstat(value)
    except OSError:
        raise click.BadParameter(
            f"descriptor {value} is not open: open it for gpufault (3>FILE, Popen pass_fds)"
        ) from None
    # Not inherited by -- CMD or a hook's child: the line is this run's.
    os.set_inheritable(value, False)
    return value


ready_fd_option = click.option(
    "--ready-fd",
    "ready_fd",
    type=int,
    metavar="N",
    default=None,
    callback=_ready_fd,
    help="once every probe is live, write `ready RUN` and a newline to descriptor N and "
    "close it (end of file without the line: the run did not start)",
)

xids_option = click.option(
    "--xids/--no-xids",
    default=True,
    show_default=True,
    help="record NVIDIA Xids and link them to the faults (when the driver's tracepoint exists)",
)

copilot_signal_option = click.option(
    "--copilot-signal",
    type=SIGNAL,
    default=None,
    help="signal the copilot uses (default SIGURG; pick one the target does not handle)",
)

mechanism_option = click.option(
    "--mechanism",
    type=click.Choice(["auto", "signal", "copilot"]),
    default=None,
    help="how fails and stalls are carried out where BPF cannot write registers: auto "
    "(default: the in-target signal helper by trial, else the ptrace copilot), signal "
    "(the helper, or refuse), copilot (GPUFAULT_SIGNAL=0 also forces it)",
)

max_db_size_option = click.option(
    "--max-db-size",
    type=SIZE,
    default=None,
    help="stop writing call rows once the database reaches this size "
    "(default 1G; K/M/G units, 64M, 1GiB; 0: no cap); faults are still written",
)

no_stack_option = click.option("--no-stack", is_flag=True, help="do not capture user stacks")


def _stack_copy(_ctx: click.Context, _param: click.Parameter, value: int | None) -> int | None:
    try:
        return None if value is None else S.check_stack_copy(value)
    except S.SpecError as e:
        raise BadValue(str(e)) from None


stack_copy_option = click.option(
    "--stack-copy",
    type=SIZE,
    default=None,
    callback=_stack_copy,
    help="user stack copied at each fire for unwinding without frame pointers "
    f"(default 16K, at most {S.STACK_COPY_MAX // 1024}K, whole 4K pages; 0: none, "
    "frame pointers only); deeper stacks (Python services) need more",
)

json_option = click.option("--json", "as_json", is_flag=True, help="machine-readable output")


def command_argument(fn: F) -> F:
    """`-- CMD ARGS`: the command to start under the faults (RunCommand
    keeps everything after `--` untouched)."""
    return click.argument("cmd", nargs=-1, type=click.UNPROCESSED)(fn)


def _metrics_addr(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if not value:
        return None
    # lazy: prometheus_client costs ~0.1 s to import: only when the option is given.
    from pyctl.observe import ObserveError
    from pyctl.observe.metrics import parse_addr

    try:
        parse_addr(value)
    except ObserveError as e:
        raise click.BadParameter(str(e).split(": ", 1)[-1]) from None
    return value


metrics_addr_option = click.option(
    "--metrics-addr",
    "metrics_addr",
    metavar="HOST:PORT",
    envvar="GPUFAULT_METRICS_ADDR",
    default=None,
    callback=_metrics_addr,
    help="serve gpufault's Prometheus metrics here while it runs (:PORT = 127.0.0.1; "
    "0.0.0.0:PORT for all interfaces)",
)


def run_options(fn: F) -> F:
    """What every run takes (trace, inject, template run): the target, the
    database, how long, how loud, the copilot's signal, -- CMD."""
    return bundle(
        target_options,
        db_option(),
        max_db_size_option,
        duration_option(
            help="stop after this long (faults expire in the kernel too), e.g. 30s, 1m30s, 2h"
        ),
        copilot_signal_option,
        mechanism_option,
        quiet_option,
        ready_fd_option,
        metrics_addr_option,
        command_argument,
    )(fn)


def fault_target_options(fn: F) -> F:
    """--lib and --fn: where a fault (or a trace) goes. Their values reach
    FaultSpec.from_fields as its lib and fn fields."""
    return bundle(
        click.option(
            "--lib", required=True, help="library: soname/name (libcuda, cuda), path, or glob"
        ),
        click.option(
            "--fn",
            "fn",
            required=True,
            multiple=True,
            help="function name or glob (cuMemAlloc*); repeat for several, each must match",
        ),
    )(fn)


class Assignment(click.ParamType):
    """KNOB=VALUE -> (KNOB, VALUE): a --set, split once; the value stays text
    for the knob to read as its default's type (templates, experiments)."""

    name = "KNOB=VALUE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        k, eq, v = str(value).partition("=")
        if not eq or not k.strip():
            raise BadValue(
                f"--set {value!r}: use KNOB=VALUE (e.g. --set nth=3)", ctx=ctx, param=param
            )
        return k.strip(), v


def set_option(help: str) -> Callable[[F], F]:
    """--set KNOB=VALUE, repeatable; the command gets `sets` as a dict."""

    def as_dict(ctx: click.Context, param: click.Parameter, value: Any) -> dict[str, str]:
        return dict(value or ())

    return click.option(
        "--set", "sets", type=Assignment(), multiple=True, callback=as_dict, help=help
    )


__all__ = [
    "CODE",
    "DURATION",
    "PROBABILITY",
    "SIGNAL",
    "SINCE",
    "SIZE",
    "Assignment",
    "Code",
    "Duration",
    "Probability",
    "Settings",
    "Signal",
    "Size",
    "db_from",
    "db_option",
    "fault_target_options",
    "run_options",
    "target_options",
]
