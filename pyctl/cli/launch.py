"""Starting a run from the command line: shared by trace, inject and
template run (and, through run_specs(), by any group that arms FaultSpecs).

RunCommand parses `options -- CMD ARGS`; run_specs() checks the target,
prints the start-up line (bcc style: what, where, "Ctrl-C to end"), runs
pyctl.runner with one RunOptions and prints the closing summary.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import click

from pyctl.api.foreground import (
    DEFAULT_MAX_DB_BYTES,
    FaultSpec,
    RunOptions,
    block_sigchld,
    run_foreground,
)
from pyctl.cli.base import UserError


def command_path(ctx: click.Context) -> str:
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
        where = command_path(ctx)
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


# The values run_options (and xids_option) give a command: a run's target
# and settings, never a fault's fields.
RUN_PARAMS = frozenset(
    {
        "pid",
        "tid",
        "cmd",
        "container",
        "cgroup",
        "pod",
        "comm",
        "ranks_of",
        "thread_name",
        "db_path",
        "max_db_size",
        "duration",
        "copilot_signal",
        "mechanism",
        "quiet",
        "ready_fd",
        "xids",
        "metrics_addr",
        "stack_copy",
    }
)


def split_run_params(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run command's values -> (the fault's fields, the run's)."""
    run = {k: v for k, v in params.items() if k in RUN_PARAMS}
    return {k: v for k, v in params.items() if k not in RUN_PARAMS}, run


def run_settings(
    kind: str,
    *,
    db_path: str,
    duration: float | None = None,
    copilot_signal: int | None = None,
    mechanism: str | None = None,
    quiet: bool = False,
    xids: bool = True,
    max_db_size: int | None = None,
    metrics_addr: str | None = None,
    ready_fd: int | None = None,
    stack_copy: int | None = None,
) -> RunOptions:
    """The RunOptions of a command line, from run_options' values (already
    converted by the value types)."""
    return RunOptions(
        db_path=db_path,
        kind=kind,
        argv=("gpufault", *sys.argv[1:]),
        duration=duration or 0.0,
        copilot_signal=copilot_signal,
        mechanism=mechanism,
        quiet=quiet,
        xids=xids,
        max_db_bytes=DEFAULT_MAX_DB_BYTES if max_db_size is None else max_db_size,
        metrics_addr=metrics_addr,
        ready_fd=ready_fd,
        stack_copy_bytes=stack_copy,
    )


def ready(fd: int, run_id: str) -> None:
    """--ready-fd: one line, then the descriptor is closed. Best effort and
    never blocking (as every other output): a reader that is gone or a full
    pipe costs the line, not the run."""
    try:
        os.set_blocking(fd, False)
        os.write(fd, f"ready {run_id}\n".encode())
    except OSError:
        pass
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def start(
    kind: str,
    specs: list[FaultSpec],
    run: dict[str, Any],
    on_end: Callable[[Any], None] | None = None,
) -> None:
    """Run specs with a command's run values (split_run_params' second half)."""
    run = dict(run)
    target = {k: run.pop(k, None) for k in ("pid", "tid")}
    cmd = run.pop("cmd", None) or ()
    chosen = {k: run.pop(k, None) for k in SELECTOR_PARAMS}
    options = run_settings(kind, **run)
    if any(v not in (None, "") for v in chosen.values()):
        # lazy: pyctl.cli.selected (the selectors' resolution) only when one is given
        from pyctl.cli.selected import run_selected

        run_selected(specs, options, chosen, pid=target["pid"], tid=target["tid"], cmd=cmd,
                     on_end=on_end, run_one=run_specs, ready=ready)  # fmt: skip
        return
    run_specs(specs, options, cmd=cmd, on_end=on_end, **target)


# The target selectors' option names (pyctl/cli/options.py target_options).
SELECTOR_PARAMS = ("container", "cgroup", "pod", "comm", "ranks_of", "thread_name")


class _NoMetrics:
    """What run_specs asks of Metrics, doing nothing (no --metrics-addr)."""

    enabled = False
    url = ""

    def on_fire(self, row: dict[str, Any]) -> None:
        pass

    def set_faults_active(self, n: int) -> None:
        pass

    def set_totals(self, **_: Any) -> None:
        pass

    def close(self, final_scrape_s: float = 0.0) -> None:
        pass


def _metrics(options: RunOptions) -> Any:
    """gpufault's own /metrics for this run (pyctl/observe/metrics.py), or
    its no-op instance without --metrics-addr."""
    if not options.metrics_addr:
        # Not importing the exporter (prometheus_client, http.server: ~0.1 s)
        # is part of the time to probes live.
        return _NoMetrics()
    # lazy: keeps pyctl.observe.metrics (+73 modules, ~300 ms) off trace's start and `--help`
    from pyctl.observe.metrics import Metrics

    m = Metrics.start(options.metrics_addr)
    if m.enabled:
        click.echo(f"  metrics: {m.url}", err=True)
    return m


class FireLines:
    """Fire lines, rate-limited: a burst in full, then a few a second, and
    for what was held back one line with its count. A sticky fault fires
    on every call (1,616 lines in 3 s once): the terminal, or a slow
    reader, was the run's bottleneck, and the lines told no one more than
    `gpufault faults --run RUN` does afterwards."""

    BURST = 10  # lines in full before the limit applies
    PER_S = 2.0  # then about this many a second
    SUMMARY_S = 1.0  # a held-back count at most this often (and at the end)

    def __init__(self, say: Callable[[str], None], run_id: Callable[[], str]) -> None:
        self._say = say
        self._run_id = run_id
        self._clock = time.monotonic
        self._tokens = float(self.BURST)
        self._last = self._summary_at = self._clock()
        self.held = 0  # not shown since the last count line
        self.held_total = 0

    def fire(self, row: dict[str, Any]) -> None:
        now = self._clock()
        self._tokens = min(float(self.BURST), self._tokens + (now - self._last) * self.PER_S)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            self._say(fire_line(row))
        else:
            self.held += 1
            self.held_total += 1
        if self.held and now - self._summary_at >= self.SUMMARY_S:
            self.flush()

    def flush(self) -> None:
        """Say how many lines were held back since the last time (the end of
        a run calls this: nothing held goes unsaid)."""
        self._summary_at = self._clock()
        if self.held:
            n, self.held = self.held, 0
            self._say(
                f"  ... {n} more fire line{'s' if n != 1 else ''} not shown "
                f"(`gpufault faults --run {self._run_id()}` lists every fault)"
            )


def fire_line(row: dict[str, Any]) -> str:
    # lazy: keeps pyctl.api.words (+1 module) off trace's start and `--help`
    from pyctl.api.words import demangle

    ret = f" -> {row['retval']}" if row.get("retval") is not None else ""
    return (
        f"FAULT {row['fault_id']}  {demangle(row['function'])}  pid {row['pid']} tid {row['tid']} "
        f"({row['comm']})  call #{row['call_seq']}  {row['action']}{ret} "
        f"[{row['mechanism']}]"
    )


def _returns_void(function: str) -> bool:
    """Does the catalog say `function` returns void?"""
    # lazy: keeps pyctl.api.words (+1 module) off trace's start and `--help`
    from pyctl.api.words import returns_void

    return returns_void(function)


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


def run_specs(
    specs: list[FaultSpec],
    options: RunOptions,
    *,
    pid: int | None = None,
    tid: int | None = None,
    cmd: Sequence[str] = (),
    on_end: Callable[[Any], None] | None = None,
) -> None:
    """Run `specs` against the target until it ends, Ctrl-C or --duration;
    with `-- CMD`, exit with the command's status. on_end(engine) runs after
    the closing line (trace prints its summary there)."""
    cmd = tuple(cmd)
    # Input first: a refused command leaves even its own signal mask alone.
    if pid is None and tid is None and not cmd:
        raise UserError("give a target: --pid PID, --tid TID or -- CMD ARGS")
    if (pid is not None or tid is not None) and cmd:
        raise UserError("use either --pid/--tid or -- CMD, not both")

    # Before any thread starts: only the copilot's tracer may take SIGCHLD.
    block_sigchld()
    # lazy: pyctl.outchan (+2 modules) only when this runs
    from pyctl import outchan

    # While the run lasts, stderr is best effort (pyctl/outchan.py): a
    # closed, broken or stuck stderr costs lines, never evidence or the
    # deadline. Put back (when it drained) after the last line.
    outchan.install_stderr()
    try:
        _run_specs(specs, options, pid=pid, tid=tid, cmd=cmd, on_end=on_end)
    finally:
        outchan.settle_stderr()


def _run_specs(
    specs: list[FaultSpec],
    options: RunOptions,
    *,
    pid: int | None,
    tid: int | None,
    cmd: tuple[str, ...],
    on_end: Callable[[Any], None] | None,
) -> None:
    # The library's foreground session: the CLI prints, the API runs.
    quiet = options.quiet

    def say(line: str) -> None:
        click.echo(line, err=True)

    # -q: warnings and errors, nothing else (not the start-up line either:
    # what waits for the probes to be live reads --ready-fd).
    info = (lambda line: None) if quiet else say
    metrics = _metrics(options)
    run_id = [""]
    lines = FireLines(info, lambda: run_id[0])

    def started(eng: Any) -> None:
        run_id[0] = eng.run_id
        metrics.set_faults_active(sum(1 for s in specs if s.action != "observe"))
        who = f"pid {pid}" if pid else (f"tid {tid}" if tid else (" ".join(cmd) or "all processes"))
        what = "; ".join(s.describe() for s in specs)
        # lazy: keeps pyctl.api.words (+1 module) off trace's start and `--help`
        from pyctl.api.words import demangle

        fns = ", ".join(sorted({demangle(a.sym.name) for a in eng.atts}))
        slow = [demangle(a.sym.name) for a in eng.atts if a.sym.slow]
        verb = "Tracing" if options.kind == "trace" else "Injecting"
        info(
            f"{verb} {what} in {who} [run {eng.run_id}, mechanism {eng.mechanism}] "
            "... Ctrl-C to end"
        )
        if options.ready_fd is not None:
            ready(options.ready_fd, eng.run_id)
        info(f"  probes: {fns}")
        if slow:
            info(f"  slow probe sites (single-stepped): {', '.join(slow)}")
        for w in getattr(eng.copilot, "warnings", None) or []:
            if cmd and "this process's child" in w:
                continue  # -- CMD: the runner leaves waiting to the copilot, as it says
            say(f"  warning: {w}")
        for w in getattr(eng, "start_warnings", None) or []:
            say(f"  warning: {w}")
        if getattr(eng, "attach_note", None):
            info(f"  note: {eng.attach_note}")
        for line in start_notes(specs, eng.atts):
            (say if line.lstrip().startswith("warning:") else info)(line)

    def fired(row: dict[str, Any]) -> None:
        metrics.on_fire(row)
        if not quiet:
            lines.fire(row)

    try:
        rc, eng = run_foreground(
            specs,
            options,
            pid=pid,
            tid=tid,
            cmd=cmd,
            on_start=started,
            on_fire=fired if metrics.enabled or not quiet else None,
            on_xid=None if quiet else (lambda x: say(f"XID {x.error_code} on {x.dev}: {x.msg}")),
        )
    except BaseException:
        lines.flush()
        metrics.close()
        raise
    lines.flush()
    st = eng.stats
    counts = st.lost or {}
    lost = counts.get("events_lost", 0) + counts.get("fires_lost", 0)
    metrics.set_faults_active(0)
    metrics.set_totals(probe_hits=st.calls, lost=lost)
    metrics.close()
    dropped = f", {st.dropped} dropped (--max-db-size)" if st.dropped or eng.capped else ""
    skipped = counts.get("fires_skipped", 0)
    # A fire skipped for want of room for its record never touched the call.
    why = (
        f", {skipped} fires skipped (their evidence record found the fires ring full, "
        "so the call ran unchanged)"
        if skipped
        else ""
    )
    errs = ", ".join(
        f"{counts[k]} {k.replace('_', ' ')}"
        for k in ("signal_err", "pending_err", "inflight_err", "corrupt_err")
        if counts.get(k)
    )
    # lazy: keeps pyctl.api.words (+1 module) off trace's start and `--help`
    from pyctl.api.words import loss_words  # at the end: not on the start path

    causes = loss_words(st.loss_causes)
    lost_words = f"{lost} lost ({causes})" if causes else f"{lost} lost"
    # Under -q too when it reports records lost, dropped or skipped, or errors:
    # a warning about the evidence, not a progress line.
    (say if lost or dropped or skipped or errs else info)(
        f"run {eng.run_id}: {st.calls} matching calls, {st.fires} fires, "
        f"{st.events} events, {lost_words}{dropped}{why}{', ' + errs if errs else ''}"
        f" -> {options.db_path}"
    )
    if on_end is not None:
        on_end(eng)
    if cmd:
        sys.exit(rc)
