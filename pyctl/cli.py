"""The gpufault command line (click). Thin: every command calls the library.

Errors a user can cause (bad pid, unknown symbol, malformed number, not
root, unsupported kernel) end in one line on stderr and exit status 2.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import click

from pyctl import __version__, store
from pyctl.spec import (
    FaultSpec,
    SpecError,
    check_range,
    parse_corrupt,
    parse_duration,
    parse_int,
    parse_predicate,
    parse_prob,
    parse_signal,
)


class UserError(click.ClickException):
    """One line on stderr, exit 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"gpufault: {self.format_message()}", err=True)


class RunFailed(UserError):
    """The run started but its evidence could not be written (disk full):
    faults stopped, run marked failed. One line on stderr, exit 3."""

    exit_code = 3


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the library's user-facing exceptions into UserError."""

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        from pyctl.engine import EngineError, StoreWriteError
        from pyctl.resolve import ResolveError

        try:
            return fn(*a, **kw)
        except StoreWriteError as e:
            raise RunFailed(str(e)) from None
        except (store.StoreError, SpecError, EngineError, ResolveError) as e:
            raise UserError(str(e)) from None
        except ValueError as e:
            raise UserError(str(e)) from None

    return wrapper


def _db_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--db",
        "db_path",
        type=click.Path(dir_okay=False),
        envvar="GPUFAULT_DB",
        default=str(store.DEFAULT_DB),
        show_default=True,
        help="evidence database",
    )(fn)


def _target_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option("--tid", type=int, help="only this thread (its process is the target)")(fn)
    fn = click.option("-p", "--pid", type=int, help="a running process (all of its threads)")(fn)
    return fn


def _command_path(ctx: click.Context) -> str:
    names = []
    c: click.Context | None = ctx
    while c is not None and c.parent is not None:
        names.append(c.info_name or "")
        c = c.parent
    return " ".join(["gpufault", *reversed(names)])


class RunCommand(click.Command):
    """trace / inject: options, then `-- CMD ARGS`.

    Everything after the first `--` is the command, untouched; before it,
    an unknown option or a stray word is an error (one line, exit 2), never
    the command to run (`trace -p 1` once ran `-p` as a program)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = list(args)
        tail: list[str] = []
        if "--" in args:
            i = args.index("--")
            args, tail = args[:i], args[i + 1 :]
        where = _command_path(ctx)
        try:
            rest = super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            close = ""
            if e.possibilities:
                close = f" (did you mean {', '.join(sorted(e.possibilities))}?)"
            raise UserError(
                f"unknown option {e.option_name}{close}: see `{where} --help`; "
                "a command to run goes after --"
            ) from None
        except click.UsageError as e:
            msg = e.format_message().rstrip(".")
            raise UserError(f"{msg[:1].lower()}{msg[1:]}: see `{where} --help`") from None
        stray = ctx.params.get("cmd") or ()
        if stray:
            raise UserError(
                f"unexpected argument {stray[0]!r}: put the command to run after --, "
                f"e.g. {where} ... -- {stray[0]} ARGS"
            )
        ctx.params["cmd"] = tuple(tail)
        return rest


def _trigger_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    opts = [
        click.option("--nth", default="0", help="fire on the Nth matching call only"),
        click.option("--every", default="0", help="fire on every Nth matching call"),
        click.option("--after", "after_n", default="0", help="fire only after N matching calls"),
        click.option("--prob", default=None, help="fire with this probability (5%, 0.05, ppm)"),
        click.option("--max", "max_fires", default="0", help="fire at most K times"),
        click.option("--sticky", is_flag=True, help="once fired, fail every later call"),
        click.option(
            "--caller",
            default=None,
            metavar="OBJ",
            help="only calls made from this object: main (the program), a library "
            "name (libtorch) or path; a libc function's internal calls then do not count",
        ),
        click.option(
            "--when",
            "when",
            default=None,
            help="argument predicate, e.g. 'arg2>=200M' (== != < > <= >= &)",
        ),
        click.option(
            "--window",
            default=None,
            help="fire only from START after start until --duration, e.g. 5s",
        ),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _fn_lib_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option(
        "--fn",
        "fn_pattern",
        required=True,
        multiple=True,
        help="function name or glob (cuMemAlloc*); repeat for several, each must match",
    )(fn)
    fn = click.option(
        "--lib", required=True, help="library: soname/name (libcuda, cuda), path, or glob"
    )(fn)
    return fn


def _resolve_ret(text: str | None, lib: str) -> tuple[int | None, str]:
    if text is None:
        return None, ""
    try:
        v = parse_int(text, "--ret")
    except SpecError:
        pass
    else:
        # One 64-bit register: -2**63 .. 2**64-1 (ctypes would wrap the rest).
        return check_range(v, "--ret", -(2**63), 2**64 - 1), text
    if re.fullmatch(r"\s*[-+]?(\d+\.\d*|\.\d+|\d+(\.\d*)?[eE][-+]?\d+|inf|nan)\s*", text, re.I):
        raise UserError(
            f"--ret: {text!r} is not an integer: give an integer (2, -1, 0x10) or a code name"
        )
    try:
        from pyctl import catalog

        return int(catalog.code_value(_catalog_lib(lib), text)), text
    except ImportError:
        raise UserError(f"--ret: {text!r} is not a number") from None
    except (ValueError, KeyError) as e:
        raise UserError(f"--ret: {e}") from None


def _catalog_lib(lib: str) -> str:
    """Whose return codes --ret names: the catalog's library for what --lib
    says (a soname, a path or a short name); CUDA's when it is none of them."""
    from pyctl import catalog
    from pyctl.catalog.libraries import library

    name = catalog.lib_for_soname(lib)
    if name is None:
        try:
            name = library(os.path.basename(lib)).name
        except ValueError:
            name = "cuda"
    return name


def _build_spec(lib: str, fn_pattern: str | tuple[str, ...], action: str, **o: Any) -> FaultSpec:
    ret, ret_text = _resolve_ret(o.get("ret"), lib)
    window = parse_duration(o["window"], "--window", allow_zero=True) if o.get("window") else 0.0
    fns = [fn_pattern] if isinstance(fn_pattern, str) else list(dict.fromkeys(fn_pattern))
    spec = FaultSpec(
        lib=lib,
        fn=fns[0] if len(fns) == 1 else fns,
        action=action,
        ret=ret,
        ret_text=ret_text,
        mode=o.get("mode") or "skip",
        signo=parse_signal(o["signal_name"]) if o.get("signal_name") else 0,
        nth=parse_int(o.get("nth") or "0", "--nth"),
        every=parse_int(o.get("every") or "0", "--every"),
        after=parse_int(o.get("after_n") or "0", "--after"),
        max_fires=parse_int(o.get("max_fires") or "0", "--max"),
        prob_ppm=parse_prob(o["prob"]) if o.get("prob") else 0,
        sticky=bool(o.get("sticky")),
        window_start_s=window,
        pred=parse_predicate(o["when"]) if o.get("when") else None,
        corrupt=parse_corrupt(o["corrupt"]) if o.get("corrupt") else None,
        stall_ms=parse_duration(o["stall"], "--stall") * 1000 if o.get("stall") else 0.0,
        trace=bool(o.get("trace")),
        entry_only=bool(o.get("entry_only")),
        capture_stack=not o.get("no_stack"),
        caller=o.get("caller") or "",
    )
    return spec.validate()


def _fire_line(row: dict[str, Any]) -> str:
    ret = f" -> {row['retval']}" if row.get("retval") is not None else ""
    return (
        f"FAULT {row['fault_id']}  {row['function']}  pid {row['pid']} tid {row['tid']} "
        f"({row['comm']})  call #{row['call_seq']}  {row['action']}{ret} "
        f"[{row['mechanism']}]"
    )


def _returns_void(function: str) -> bool:
    """Does the catalog say `function` returns void?"""
    try:
        from pyctl import catalog

        info = catalog.lookup(function)
    except Exception:  # noqa: BLE001 - the catalog is optional
        return False
    return info is not None and info.ret_kind.split(":", 1)[-1].strip() == "void"


def start_notes(specs: list[FaultSpec], atts: list[Any]) -> list[str]:
    """Lines printed once the probes are in: what a run will not record or
    cannot do, so that it does not do so silently."""
    out = []
    for i, s in enumerate(specs):
        if s.action == "observe" and not s.trace:
            out.append(
                f"  note: {s.fn_text}: --action observe without --trace records no calls and "
                "no faults, only the count of matching calls at the end (triggers such as "
                "--nth do not apply to observe): add --trace to record every call"
            )
        if s.action == "fail":
            void = sorted({a.sym.name for a in atts if a.spec == i and _returns_void(a.sym.name)})
            if void:
                out.append(
                    f"  warning: {', '.join(void)} returns void (catalog), so --ret "
                    f"{s.ret_text or s.ret} is a value no caller reads: --mode skip only skips "
                    "the body; for an error the caller sees use --action signal, stall or corrupt"
                )
    return out


def _run_engine(
    specs: list[FaultSpec],
    pid: int | None,
    tid: int | None,
    cmd: tuple[str, ...],
    db_path: str,
    duration: float,
    kind: str,
    copilot_signal: str | None,
    quiet: bool,
    xids: bool = True,
    max_db_size: str | None = None,
) -> None:
    from pyctl.engine import DEFAULT_MAX_DB_BYTES
    from pyctl.runner import Target, run

    max_db_bytes = DEFAULT_MAX_DB_BYTES
    if max_db_size is not None:
        max_db_bytes = parse_int(max_db_size, "--max-db-size")
        if max_db_bytes < 0:
            raise UserError(f"--max-db-size: {max_db_size!r} is negative (0: no cap)")

    # Input first: a refused command leaves even its own signal mask alone.
    if pid is None and tid is None and not cmd:
        raise UserError("give a target: --pid PID, --tid TID or -- CMD ARGS")
    if (pid is not None or tid is not None) and cmd:
        raise UserError("use either --pid/--tid or -- CMD, not both")
    sig = parse_signal(copilot_signal, "--copilot-signal") if copilot_signal else None

    try:
        from pyctl.copilot import block_sigchld

        # Before any thread starts: only the copilot's tracer may take SIGCHLD.
        block_sigchld()
    except ImportError:
        pass
    argv = ["gpufault", *sys.argv[1:]]

    def started(eng: Any) -> None:
        who = f"pid {pid}" if pid else (f"tid {tid}" if tid else (" ".join(cmd) or "all processes"))
        what = "; ".join(s.describe() for s in specs)
        fns = ", ".join(sorted({a.sym.name for a in eng.atts}))
        slow = [a.sym.name for a in eng.atts if a.sym.slow]
        click.echo(
            f"{'Tracing' if kind == 'trace' else 'Injecting'} {what} in {who} "
            f"[run {eng.run_id}, mechanism {eng.mechanism}] ... Ctrl-C to end",
            err=True,
        )
        click.echo(f"  probes: {fns}", err=True)
        if slow:
            click.echo(f"  slow probe sites (single-stepped): {', '.join(slow)}", err=True)
        for w in getattr(eng.copilot, "warnings", None) or []:
            if cmd and "this process's child" in w:
                continue  # -- CMD: the runner leaves waiting to the copilot, as it says
            click.echo(f"  warning: {w}", err=True)
        for line in start_notes(specs, eng.atts):
            click.echo(line, err=True)

    on_fire = None if quiet else (lambda row: click.echo(_fire_line(row), err=True))
    rc, eng = run(
        specs,
        Target(pid=pid, tid=tid, cmd=cmd),
        db_path=db_path,
        argv=argv,
        kind=kind,
        duration=duration,
        copilot_signal=sig,
        on_start=started,
        on_fire=on_fire,
        status=not quiet,
        xids=xids,
        on_xid=None if quiet else (
            lambda x: click.echo(f"XID {x.error_code} on {x.dev}: {x.msg}", err=True)),
        max_db_bytes=max_db_bytes,
    )
    st = eng.stats
    counts = st.lost or {}
    lost = counts.get("events_lost", 0) + counts.get("fires_lost", 0)
    dropped = f", {st.dropped} dropped (--max-db-size)" if st.dropped or eng.capped else ""
    skipped = counts.get("fires_skipped", 0)
    # A fire skipped for want of room for its record never touched the call.
    why = (f", {skipped} fires skipped (their evidence record found the fires ring full, "
           "so the call ran unchanged)") if skipped else ""
    errs = ", ".join(f"{counts[k]} {k.replace('_', ' ')}" for k in
                     ("signal_err", "pending_err", "inflight_err", "corrupt_err")
                     if counts.get(k))
    click.echo(
        f"run {eng.run_id}: {st.calls} matching calls, {st.fires} fires, "
        f"{st.events} events, {lost} lost{dropped}{why}{', ' + errs if errs else ''}"
        f" -> {db_path}",
        err=True,
    )
    if cmd:
        sys.exit(rc)


_DEBUG = bool(os.environ.get("GPUFAULT_DEBUG"))


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    global _DEBUG
    _DEBUG = _DEBUG or value


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpufault")
@click.option("--debug", is_flag=True, is_eager=True, expose_value=False, callback=_set_debug,
              help="show the traceback of an internal error (also GPUFAULT_DEBUG=1)")
def cli() -> None:
    """Fault injection and fault forensics for GPU inference stacks.

    \b
    Examples:
      gpufault doctor
      gpufault probes libcuda --pid 1234
      gpufault trace --pid 1234 --lib libcuda --fn 'cuMemAlloc*'
      gpufault inject --pid 1234 --lib libcuda --fn cuMemAlloc_v2 \\
          --action fail --ret CUDA_ERROR_OUT_OF_MEMORY --nth 3
      gpufault faults
      gpufault show 1a2b3c4d-1
    """


def _mark(ok: bool, required: bool) -> str:
    """ok / FAIL / WARN (a failing check the requested work does not need),
    highlighted only on a terminal."""
    text, color = ("ok  ", None) if ok else ("FAIL", "red") if required else ("WARN", "yellow")
    return click.style(text, fg=color, bold=True) if color and sys.stdout.isatty() else text


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--for", "features", multiple=True,
              type=click.Choice(["trace", "inject", "xids", "tokenizer-count", "all"]),
              help="the work to check for (repeatable; default: trace and inject)")
def doctor(as_json: bool, features: tuple[str, ...]) -> None:
    """What this kernel and host allow, each with a fix.

    Exits 1 when a check that the requested work needs fails (FAIL); a
    failing check it does not need is a WARN.

    \b
    Examples:
      gpufault doctor
      gpufault doctor --for xids --json
    """
    from pyctl.capabilities import DEFAULT_FEATURES, FEATURES, checks, failed_for

    want = list(FEATURES) if "all" in features else list(features or DEFAULT_FEATURES)
    res = checks()
    bad = failed_for(res, want)
    if as_json:
        click.echo(json.dumps({
            "features": {f: FEATURES[f] for f in want},
            "ok": not bad,
            "checks": [dict(c.__dict__, required=bool(set(want) & set(c.required_for)))
                       for c in res],
        }, indent=2))
    else:
        for c in res:
            req = bool(set(want) & set(c.required_for))
            click.echo(f"{_mark(c.ok, req)} {c.name:22} {c.detail}")
            if not c.ok and c.fix:
                click.echo(f"     {'':22} fix: {c.fix}")
        if bad:
            click.echo(f"gpufault: {', '.join(c.name for c in bad)} failed: "
                       f"{' / '.join(want)} cannot run here until fixed", err=True)
    if bad:
        sys.exit(1)


@cli.command()
@click.argument("lib", required=False)
@click.option("-p", "--pid", type=int, help="resolve LIB in this process")
@click.option(
    "--fn", "fn_pattern", multiple=True, help="glob over function names (repeatable; default *)"
)
@click.option("--json", "as_json", is_flag=True)
@_user_errors
def probes(lib: str | None, pid: int | None, fn_pattern: tuple[str, ...], as_json: bool) -> None:
    """List probe sites: the catalog, or the functions of LIB.

    \b
    Without LIB: the catalogued functions (CUDA driver, NCCL, cuBLAS, cuFFT).
    With LIB: its functions matching --fn, the probe offset, and whether the
    kernel must single-step the first instruction (slow, ~16 us a hit).
    \b
    Examples:
      gpufault probes
      gpufault probes libcuda --fn 'cuMemAlloc*'
      gpufault probes /usr/lib/x86_64-linux-gnu/libc.so.6 --fn 'mall*'
    """
    from pyctl import resolve

    rows: list[dict[str, Any]]
    if lib is None:
        try:
            from pyctl import catalog
        except ImportError:
            raise UserError("no catalog installed") from None
        rows = [
            {
                "lib": f.lib,
                "function": f.name,
                "args": ", ".join(f"{a.ctype} {a.name}" for a in f.args),
            }
            for f in catalog.functions()
        ]
        if as_json:
            click.echo(json.dumps(rows, indent=2))
        else:
            for r in rows:
                click.echo(f"{r['lib']:7} {r['function']}({r['args']})")
        return
    L = resolve.find_library(lib, pid)
    syms = resolve.symbols(L, list(fn_pattern) or ["*"])
    rows = [
        {
            "function": s.name,
            "aliases": s.aliases,
            "address": s.address,
            "offset": s.offset,
            "first_insn": s.first_insn,
            "skipped_endbr64": s.skipped_endbr,
            "slow": s.slow,
        }
        for s in sorted(syms, key=lambda s: s.name)
    ]
    if as_json:
        click.echo(
            json.dumps({"library": L.display, "mapped": L.mapped, "functions": rows}, indent=2)
        )
        return
    click.echo(f"{L.display} ({'mapped' if L.mapped else 'on disk'}), {len(rows)} functions")
    for r in rows:
        note = (
            "SLOW (single-stepped)"
            if r["slow"]
            else ("after endbr64" if r["skipped_endbr64"] else "")
        )
        click.echo(f"  {r['function']:40} +{r['offset']:#x} {r['first_insn']:8} {note}")


def _common_run_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.argument("cmd", nargs=-1, type=click.UNPROCESSED)(fn)
    fn = click.option("--quiet", "-q", is_flag=True, help="no per-fire lines, no status")(fn)
    fn = click.option(
        "--copilot-signal",
        default=None,
        help="signal the copilot uses (default SIGURG; pick one the target does not handle)",
    )(fn)
    fn = click.option(
        "--duration",
        default=None,
        help="stop after this long (faults expire in the kernel too), e.g. 30s, 1m30s, 2h",
    )(fn)
    fn = click.option(
        "--max-db-size",
        default=None,
        help="stop writing call rows once the database reaches this size "
        "(default 1G; K/M/G units; 0: no cap); faults are still written",
    )(fn)
    fn = _db_option(fn)
    fn = _target_options(fn)
    return fn


@cli.command(cls=RunCommand)
@_fn_lib_options
@click.option("--no-stack", is_flag=True, help="do not capture user stacks")
@click.option(
    "--entry-only",
    is_flag=True,
    help="record entries only (args, no return/latency): half the probe cost",
)
@_common_run_options
@_user_errors
def trace(
    lib: str,
    fn_pattern: tuple[str, ...],
    no_stack: bool,
    entry_only: bool,
    pid: int | None,
    tid: int | None,
    db_path: str,
    max_db_size: str | None,
    duration: str | None,
    copilot_signal: str | None,
    quiet: bool,
    cmd: tuple[str, ...],
) -> None:
    """Trace calls: args, return codes, latency, into the database.

    \b
    Examples:
      gpufault trace --pid 1234 --lib libcuda --fn 'cuMemAlloc*' --duration 10s
      gpufault trace --lib libgftarget --fn gf_victim -- ./build/targets/gf_target
    """
    spec = _build_spec(
        lib, fn_pattern, "observe", trace=True, no_stack=no_stack, entry_only=entry_only
    )
    dur = parse_duration(duration) if duration else 0.0
    _run_engine([spec], pid, tid, cmd, db_path, dur, "trace", copilot_signal, quiet,
                max_db_size=max_db_size)


@cli.command(cls=RunCommand)
@_fn_lib_options
@click.option(
    "--action",
    type=click.Choice(["observe", "fail", "signal", "corrupt", "stall"]),
    default="fail",
    show_default=True,
)
@click.option("--ret", default=None, help="fail: the return value, a number or a code name")
@click.option(
    "--mode",
    type=click.Choice(["skip", "after"]),
    default="skip",
    show_default=True,
    help="fail: skip the body, or run it and replace the return value",
)
@click.option("--signal", "signal_name", default=None, help="signal: SIGSEGV, SIGBUS, ...")
@click.option(
    "--corrupt", default=None, help="corrupt: argN[+OFF][:zero|xor=M|set=V][:LEN], e.g. arg1:zero"
)
@click.option("--stall", default=None, help="stall: how long (20ms); omit for a hang")
@click.option("--trace", "trace_calls", is_flag=True, help="also record every call")
@click.option("--no-stack", is_flag=True, help="do not capture user stacks")
@_trigger_options
@_common_run_options
@_user_errors
def inject(
    lib: str,
    fn_pattern: tuple[str, ...],
    action: str,
    ret: str | None,
    mode: str,
    signal_name: str | None,
    corrupt: str | None,
    stall: str | None,
    trace_calls: bool,
    no_stack: bool,
    nth: str,
    every: str,
    after_n: str,
    prob: str | None,
    max_fires: str,
    sticky: bool,
    caller: str | None,
    when: str | None,
    window: str | None,
    pid: int | None,
    tid: int | None,
    db_path: str,
    max_db_size: str | None,
    duration: str | None,
    copilot_signal: str | None,
    quiet: bool,
    cmd: tuple[str, ...],
) -> None:
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
    spec = _build_spec(
        lib,
        fn_pattern,
        action,
        ret=ret,
        mode=mode,
        signal_name=signal_name,
        corrupt=corrupt,
        stall=stall,
        trace=trace_calls,
        no_stack=no_stack,
        nth=nth,
        every=every,
        after_n=after_n,
        prob=prob,
        max_fires=max_fires,
        sticky=sticky,
        caller=caller,
        when=when,
        window=window,
    )
    dur = parse_duration(duration) if duration else 0.0
    _run_engine([spec], pid, tid, cmd, db_path, dur, "inject", copilot_signal, quiet,
                max_db_size=max_db_size)


@cli.command()
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
    from pyctl.control import ControlError
    from pyctl.control import release as release_all

    try:
        done, stale = release_all(ctl_pid)
    except ControlError as e:
        raise UserError(str(e)) from None
    if stale:
        click.echo(f"removed {stale} stale control socket(s) of controllers that died")
    if not done:
        who = (f"gpufault controller with pid {ctl_pid}" if ctl_pid
               else "running gpufault controller")
        raise UserError(f"no {who} found: nothing to release")
    for r in done:
        click.echo(f"asked controller {r.pid} (run {r.run_id}) to release stalled threads")


def _open_existing(db_path: str) -> Any:
    """Read-only (SQLite mode=ro): faults/show never create, convert, chmod
    or add tables to the file; a database that is not gpufault's is refused."""
    try:
        return store.open_db(db_path, readonly=True)
    except store.StoreError as e:
        raise UserError(str(e)) from None


@cli.command()
@_db_option
@click.option("--run", "run_id", default=None, help="only this run")
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def faults(db_path: str, run_id: str | None, limit: int, as_json: bool) -> None:
    """List fired faults, newest first.

    \b
    Example:
      gpufault faults --limit 10
    """
    from pyctl import query

    db = _open_existing(db_path)
    rows = query.faults(db, run_id=run_id, limit=limit)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no faults recorded")
        return
    click.echo(f"{'FAULT':14} {'FUNCTION':24} {'ACTION':8} {'RET':>6} {'PID':>7} {'TID':>7} LINKS")
    for r in rows:
        ret = "" if r["ret"] is None else str(r["ret"])
        click.echo(
            f"{r['fault_id']:14} {r['function'][:24]:24} {r['action']:8} {ret:>6} "
            f"{r['pid']:>7} {r['tid']:>7} {r['links']}"
        )


@cli.command()
@click.argument("fault_id")
@_db_option
@click.option("--json", "as_json", is_flag=True)
@_user_errors
def show(fault_id: str, db_path: str, as_json: bool) -> None:
    """Everything known about one fault: call, registers, stack, what followed.

    \b
    Example:
      gpufault show 1a2b3c4d-1
    """
    from pyctl import query

    db = _open_existing(db_path)
    doc = query.fault_chain(db, fault_id)
    if doc is None:
        raise UserError(f"no fault {fault_id} in {db_path}: list them with `gpufault faults`")
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(query.render_chain(doc))


@cli.command()
@_db_option
@click.option("--threads", default=2, show_default=True)
@click.option("--steps", default=6, show_default=True)
@_user_errors
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


def _register_groups() -> None:
    """Sub-command groups owned by other modules, registered explicitly: a
    group whose module fails to import is a bug to see, not a group to
    drop (none of them imports an optional package at import time)."""
    from pyctl.anchors.cli import anchors
    from pyctl.hooks_cli import hooks_group, netchaos_group
    from pyctl.service.cli import service
    from pyctl.templates_cli import template
    from pyctl.tokenizer.cli import tokenizer

    for group in (tokenizer, anchors, hooks_group, netchaos_group, template, service):
        cli.add_command(group)


_register_groups()


def main(argv: list[str] | None = None) -> None:
    """The `gpufault` entry point: every command group under one error
    contract (pyctl/errors.py): exit 2 and one line for what the user or
    the machine must change, 70 and one line for a bug, 130 for Ctrl-C."""
    from pyctl import errors

    try:
        rc = cli.main(args=argv, prog_name="gpufault", standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("gpufault: interrupted", err=True)
        sys.exit(errors.EXIT_INTERRUPTED)
    except KeyboardInterrupt:
        click.echo("gpufault: interrupted", err=True)
        sys.exit(errors.EXIT_INTERRUPTED)
    except click.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "gpufault"
        click.echo(f"gpufault: {e.format_message().rstrip('.')}: see {where} --help", err=True)
        sys.exit(errors.EXIT_USER)
    except click.ClickException as e:
        click.echo(f"gpufault: {e.format_message()}", err=True)
        # Ours carry their status (RunFailed: 3); click's own say 1: make it 2.
        sys.exit(e.exit_code if isinstance(e, UserError) else errors.EXIT_USER)
    except errors.user_error_types() as e:
        if _DEBUG:
            raise
        click.echo(f"gpufault: {errors.one_line(e)}", err=True)
        sys.exit(errors.EXIT_USER)
    except Exception as e:  # noqa: BLE001 - the one place a bug becomes one line
        if _DEBUG:
            raise
        click.echo(f"gpufault: internal error: {type(e).__name__}: {errors.one_line(e)}: "
                   "run with --debug for the traceback", err=True)
        sys.exit(errors.EXIT_INTERNAL)
    sys.exit(rc if isinstance(rc, int) else 0)
