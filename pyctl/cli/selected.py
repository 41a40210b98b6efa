"""trace/inject/template run with a target selector (--container,
--cgroup, --pod, --comm, --ranks-of, --thread): resolved through the
library (gpufault.Target), then run as one process's run (the ordinary
foreground path, with the member's labels) or, for several, as a
SessionGroup: one isolated session per process, fires in one stream,
Ctrl-C or --duration ends them all."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import click

from pyctl.api.errors import GpufaultError
from pyctl.api.foreground import FaultSpec, RunOptions
from pyctl.api.target import Target
from pyctl.cli.base import UserError

_FLAGS = {"container": "--container", "cgroup": "--cgroup", "pod": "--pod", "comm": "--comm",
          "ranks_of": "--ranks-of", "thread_name": "--thread"}  # fmt: skip


def selected_target(
    chosen: dict[str, Any], *, pid: int | None, tid: int | None, cmd: Sequence[str]
) -> Target:
    """The library Target the options name (one line for a bad mix)."""
    given = {k: v for k, v in chosen.items() if v not in (None, "")}
    sels = [k for k in given if k != "thread_name"]
    if len(sels) > 1:
        raise UserError(f"give one of {', '.join(_FLAGS[k] for k in sels)}, not several")
    if cmd:
        raise UserError(f"{_FLAGS[(sels or ['thread_name'])[0]]} selects running processes: "
                        "drop it or the -- CMD")  # fmt: skip
    if tid is not None:
        raise UserError("--tid names one thread already: drop it or the selector")
    if sels and pid is not None:
        raise UserError(f"use either --pid or {_FLAGS[sels[0]]}, not both")
    try:
        if sels:
            k = sels[0]
            tgt = getattr(Target, k)(given[k])
        elif pid is not None:
            tgt = Target.process(pid)
        else:
            raise UserError("--thread NAME: say whose threads: add --pid PID or a selector")
        if given.get("thread_name"):
            tgt = tgt.threads(given["thread_name"])
    except GpufaultError as e:
        raise UserError(str(e)) from None
    return tgt


def run_selected(
    specs: list[FaultSpec],
    options: RunOptions,
    chosen: dict[str, Any],
    *,
    pid: int | None,
    tid: int | None,
    cmd: Sequence[str],
    on_end: Callable[[Any], None] | None,
    run_one: Callable[..., None],
    ready: Callable[[int, str], None],
) -> None:
    """run_one: launch's run_specs (one process); ready: its --ready-fd
    writer (passed in: launch imports this module)."""
    tgt = selected_target(chosen, pid=pid, tid=tid, cmd=cmd)
    try:
        members = tgt.members(sorted({s.lib for s in specs if s.lib}))
    except GpufaultError as e:
        raise UserError(str(e)) from None
    if len(members) == 1:
        m = members[0]
        run_one(specs, replace(options, target_labels=m.labels), pid=m.pid, tid=m.tid,
                  on_end=on_end)  # fmt: skip
        return
    if options.metrics_addr:
        raise UserError(f"--metrics-addr serves one run; {tgt.describe()} is "
                        f"{len(members)} processes: give --pid of one, or drop it")  # fmt: skip
    _run_group(specs, options, tgt, members, on_end, ready)


def _member_line(t: Target) -> str:
    lab = dict(t.labels)
    bits = [f"pid {t.pid}"] + ([f"tid {t.tid}"] if t.tid else [])
    if lab.get("rank") is not None:
        bits.append(f"rank {lab['rank']}")
    return " ".join(bits)


def _run_group(
    specs: list[FaultSpec], options: RunOptions, tgt: Target, members: list[Target],
    on_end: Callable[[Any], None] | None, ready: Callable[[int, str], None],
) -> None:  # fmt: skip
    # lazy: the library's session group only for a selection of several
    from pyctl.api.group import SessionGroup
    from pyctl.api.session import IsolatedSession, Settings

    say = (lambda line: None) if options.quiet else (lambda line: click.echo(line, err=True))
    settings = Settings(
        db=str(options.db_path), duration=options.duration, kind=options.kind,
        argv=tuple(options.argv), xids=options.xids, max_db_bytes=options.max_db_bytes,
        copilot_signal=options.copilot_signal, stack_copy_bytes=options.stack_copy_bytes,
        mechanism=options.mechanism or "auto",
    )  # fmt: skip
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    shown = [0]

    def fired(f: Any) -> None:
        if shown[0] < 20:  # a burst in full; `gpufault faults` lists every one
            shown[0] += 1
            say(f"FAULT {f.fault_id}  {f.function}  tid {f.tid}  {f.action}")

    try:
        try:
            group = SessionGroup([IsolatedSession(specs, m, settings) for m in members])
            group.arm_all(fired)
        except GpufaultError as e:
            raise UserError(str(e)) from None
        verb = "Tracing" if options.kind == "trace" else "Injecting"
        what = "; ".join(s.describe() for s in specs)
        say(f"{verb} {what} in {tgt.describe()}: {len(members)} processes "
            f"[runs {' '.join(group.run_ids)}] ... Ctrl-C to end")  # fmt: skip
        for t, r in zip(group.members, group.run_ids, strict=True):
            say(f"  {_member_line(t)}: run {r}")
        if options.ready_fd is not None:
            ready(options.ready_fd, " ".join(group.run_ids))
        deadline = time.monotonic() + options.duration if options.duration else None
        while not stop.is_set() and group.active:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            stop.wait(0.2 if left is None else min(left, 0.2))
        group.disarm()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    c = group.counters
    if shown[0] < c.fires:
        say(f"  ... {c.fires - shown[0]} more fire lines not shown "
            f"(`gpufault faults --db {options.db_path}` lists every fault)")  # fmt: skip
    per = ", ".join(f"{_member_line(s.target)}: {s.counters.calls} calls, {s.counters.fires} fires"
                    for s in group.sessions)  # fmt: skip
    lost = f", {c.lost} lost" if c.lost else ""
    say(f"Ended: {c.calls} calls, {c.fires} fires{lost} in {len(members)} processes ({per})")
    failed = [s for s in group.sessions if s.error is not None]
    for s in failed:
        click.echo(f"gpufault: {_member_line(s.target)}: {s.error}", err=True)
    if on_end is not None:
        for s in group.sessions:
            if s.run_id:
                on_end(SimpleNamespace(db_path=options.db_path, run_id=s.run_id))
    if failed:
        raise SystemExit(1)
