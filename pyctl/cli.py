"""The gpufault command line (click). Thin: every command calls the library.

Errors a user can cause (bad pid, unknown symbol, malformed number, not
root, unsupported kernel) end in one line on stderr and exit status 2.
"""

from __future__ import annotations

import functools
import json
import os
import signal as _signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from pyctl import __version__, store
from pyctl.spec import (
    FaultSpec,
    SpecError,
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


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn the library's user-facing exceptions into UserError."""

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        from pyctl.engine import EngineError
        from pyctl.resolve import ResolveError

        try:
            return fn(*a, **kw)
        except (SpecError, EngineError, ResolveError) as e:
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
    fn = click.option("--pid", type=int, help="a running process (all of its threads)")(fn)
    return fn


def _trigger_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    opts = [
        click.option("--nth", default="0", help="fire on the Nth matching call only"),
        click.option("--every", default="0", help="fire on every Nth matching call"),
        click.option("--after", "after_n", default="0", help="fire only after N matching calls"),
        click.option("--prob", default=None, help="fire with this probability (5%, 0.05, ppm)"),
        click.option("--max", "max_fires", default="0", help="fire at most K times"),
        click.option("--sticky", is_flag=True, help="once fired, fail every later call"),
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
        "--fn", "fn_pattern", required=True, help="function name or glob (cuMemAlloc*)"
    )(fn)
    fn = click.option(
        "--lib", required=True, help="library: soname/name (libcuda, cuda), path, or glob"
    )(fn)
    return fn


def _resolve_ret(text: str | None, lib: str) -> tuple[int | None, str]:
    if text is None:
        return None, ""
    try:
        return parse_int(text, "--ret"), text
    except SpecError:
        pass
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


def _build_spec(lib: str, fn_pattern: str, action: str, **o: Any) -> FaultSpec:
    ret, ret_text = _resolve_ret(o.get("ret"), lib)
    window = parse_duration(o["window"], "--window") if o.get("window") else 0.0
    spec = FaultSpec(
        lib=lib,
        fn=fn_pattern,
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
    )
    return spec.validate()


def _fire_line(row: dict[str, Any]) -> str:
    ret = f" -> {row['retval']}" if row.get("retval") is not None else ""
    return (
        f"FAULT {row['fault_id']}  {row['function']}  pid {row['pid']} tid {row['tid']} "
        f"({row['comm']})  call #{row['call_seq']}  {row['action']}{ret} "
        f"[{row['mechanism']}]"
    )


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
) -> None:
    from pyctl.runner import Target, run

    try:
        from pyctl.copilot import block_sigchld

        # Before any thread starts: only the copilot's tracer may take SIGCHLD.
        block_sigchld()
    except ImportError:
        pass

    if pid is None and tid is None and not cmd and any(s.action != "observe" for s in specs):
        raise UserError("give a target: --pid PID, --tid TID or -- CMD ARGS")
    if pid is not None and cmd:
        raise UserError("use either --pid or -- CMD, not both")
    sig = parse_signal(copilot_signal) if copilot_signal else None
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
    )
    st = eng.stats
    lost = sum(st.lost.values()) if st.lost else 0
    click.echo(
        f"run {eng.run_id}: {st.calls} matching calls, {st.fires} fires, "
        f"{st.events} events, {lost} lost -> {db_path}",
        err=True,
    )
    if cmd:
        sys.exit(rc)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpufault")
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


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def doctor(as_json: bool) -> None:
    """What this kernel and host allow, each with a fix.

    \b
    Example:
      gpufault doctor
    """
    from pyctl.capabilities import checks

    res = checks()
    if as_json:
        click.echo(json.dumps([c.__dict__ for c in res], indent=2))
    else:
        for c in res:
            mark = "ok  " if c.ok else "FAIL"
            click.echo(f"{mark} {c.name:22} {c.detail}")
            if not c.ok and c.fix:
                click.echo(f"     {'':22} fix: {c.fix}")
    if not all(c.ok for c in res if c.name in ("root", "libbpf", "bpf objects", "bpf + uprobes")):
        sys.exit(1)


@cli.command()
@click.argument("lib", required=False)
@click.option("--pid", type=int, help="resolve LIB in this process")
@click.option("--fn", "fn_pattern", default="*", help="glob over function names")
@click.option("--json", "as_json", is_flag=True)
@_user_errors
def probes(lib: str | None, pid: int | None, fn_pattern: str, as_json: bool) -> None:
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
    syms = resolve.symbols(L, fn_pattern)
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
        help="stop after this long (faults expire in the kernel too), e.g. 30s",
    )(fn)
    fn = _db_option(fn)
    fn = _target_options(fn)
    return fn


@cli.command(context_settings={"ignore_unknown_options": True})
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
    fn_pattern: str,
    no_stack: bool,
    entry_only: bool,
    pid: int | None,
    tid: int | None,
    db_path: str,
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
    _run_engine([spec], pid, tid, cmd, db_path, dur, "trace", copilot_signal, quiet)


@cli.command(context_settings={"ignore_unknown_options": True})
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
    fn_pattern: str,
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
    when: str | None,
    window: str | None,
    pid: int | None,
    tid: int | None,
    db_path: str,
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
        when=when,
        window=window,
    )
    dur = parse_duration(duration) if duration else 0.0
    _run_engine([spec], pid, tid, cmd, db_path, dur, "inject", copilot_signal, quiet)


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
    from pyctl.runner import RUN_DIR

    pids = [ctl_pid] if ctl_pid else [int(p.stem) for p in RUN_DIR.glob("*.run")]
    sent = 0
    for p in pids:
        try:
            os.kill(p, _signal.SIGUSR1)
            sent += 1
        except ProcessLookupError:
            continue
    if not sent:
        raise UserError("no running gpufault controller found")
    click.echo(f"asked {sent} controller(s) to release stalled threads")


def _open_existing(db_path: str) -> Any:
    if not Path(db_path).exists():
        raise UserError(f"no database at {db_path}: run gpufault trace/inject first, or pass --db")
    return store.open_db(db_path)


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

    Runs the CPU stand-in workload (build/doubles/gf-infer, a test double
    of libcuda) under gpufault and prints the fault's evidence.

    \b
    Example:
      make demo
    """
    from pyctl import demo as demo_mod

    demo_mod.run(db_path, threads=threads, steps=steps)


def _register_optional() -> None:
    """Sub-command groups owned by other modules (present when installed)."""
    for mod, name in (
        ("pyctl.tokenizer.cli", "tokenizer"),
        ("pyctl.anchors.cli", "anchors"),
        ("pyctl.hooks_cli", "hooks_group"),
        ("pyctl.hooks_cli", "netchaos_group"),
        ("pyctl.templates_cli", "template"),
    ):
        try:
            m = __import__(mod, fromlist=[name])
            cli.add_command(getattr(m, name))
        except (ImportError, AttributeError):
            continue


_register_optional()
