"""In-kernel call summaries: counts, error returns and log2 latency
histograms kept in BPF maps (bpf/aggregate.bpf.c), no ring event per call.

    with Aggregator(pid, "libcuda", ["cuMemAlloc*"]) as agg:
        time.sleep(5)
        print(agg.read().render())

Functions are resolved as `gpufault trace` resolves them (pyctl/symbols/resolve.py:
the target's maps, sonames, globs, `tok:KIND`). Attach: one uprobe_multi
link per direction where the kernel has them (one RCU wait at detach),
else one link per site. Without latency only the entry program is loaded
(no uretprobe: about half the cost of a probed call).

Nothing outlives this object: links and the BPF object are closed by
close() on every path (an error in start(), Ctrl-C, the target's exit),
and being file descriptors of this process, by the kernel if it dies.
"""

from __future__ import annotations

import ctypes as C
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pyctl import paths
from pyctl.bpf import aggregate_abi as abi
from pyctl.bpf.libbpf import (
    BPF_TRACE_UPROBE_MULTI,
    BPF_TRACE_UPROBE_SESSION,
    BpfError,
    Object,
    lib,
    map_lookup,
)
from pyctl.calls.summary import FuncSummary, Summary, from_counts
from pyctl.capabilities import uprobe_multi
from pyctl.catalog.rules import ErrorRule, error_rule
from pyctl.exceptions import GpufaultError
from pyctl.procstate import live_tid
from pyctl.symbols import resolve

OBJ_NAME = "aggregate"
PROGS = ("agg_count", "agg_session", "agg_entry", "agg_return")
MODE_PROGS = {
    "count": ("agg_count",),
    "session": ("agg_session",),
    "pair": ("agg_entry", "agg_return"),
}
PROBE_NAMES = {
    "count": "entry uprobe",
    "session": "uprobe session (entry + return, one program)",
    "pair": "entry uprobe + uretprobe",
}
MAX_THREAD_KEYS = 16384  # (function, thread) pairs kept when per thread


class AggregateError(GpufaultError):
    """One-line, user-facing; nothing is left attached."""


@dataclass
class Site:
    func: int  # index: the cookie's low half, the stats array's key
    lib: resolve.Library
    sym: resolve.Symbol
    rule: ErrorRule


def plan(pid: int, lib_name: str, fns: Sequence[str]) -> list[Site]:
    """Resolve --lib/--fn in the target. Raises AggregateError on bad input."""
    if pid <= 0 or not resolve.pid_alive(pid):
        raise AggregateError(f"no process {pid}: check the pid (is it still running?)")
    try:
        lib_ = resolve.find_library(lib_name, pid)
        syms = resolve.symbols(lib_, list(fns))
    except resolve.ResolveError as e:
        raise AggregateError(str(e)) from None
    return [
        Site(i, lib_, s, error_rule(s.name, lib_.display))
        for i, s in enumerate(sorted(syms, key=lambda s: s.name))
    ]


def _num_cpus() -> int:
    """Possible CPUs: a per-CPU map's value, read from user space, holds one
    slot per possible CPU."""
    f = lib().libbpf_num_possible_cpus
    f.restype = C.c_int
    f.argtypes = []
    n = int(f())
    if n <= 0:
        raise AggregateError(f"cannot count possible CPUs ({os.strerror(-n)})")
    return n


def _keys(fd: int, key_type: type[C.Structure]) -> list[Any]:
    """Every key of a hash map (walked once, at the end: nothing writes)."""
    get_next = lib().bpf_map_get_next_key
    out = []
    cur: Any = None
    nxt = key_type()
    while get_next(fd, None if cur is None else C.byref(cur), C.byref(nxt)) == 0:
        cur = key_type.from_buffer_copy(nxt)
        out.append(cur)
        if len(out) > 1 << 22:  # never loop for ever on a changing map
            break
    return out


class Aggregator:
    """One in-kernel summary session on one process."""

    def __init__(
        self,
        pid: int,
        lib_name: str,
        fns: Sequence[str],
        *,
        latency: bool = True,
        per_thread: bool = False,
    ):
        self.pid = int(pid)
        self.lib_name = lib_name
        self.fns = list(fns)
        self.latency = latency
        self.per_thread = per_thread
        self.sites: list[Site] = []
        self.obj: Object | None = None
        self.multi = False
        self.mode = ""  # how it probes: see modes()
        self.started_at = 0.0
        self.ended_at = 0.0

    # ---- set-up -----------------------------------------------------------
    def start(self) -> None:
        """Check, resolve, load, attach; on any error (or Ctrl-C) undo all."""
        if os.geteuid() != 0:
            raise AggregateError("gpufault needs root (BPF, uprobes): run it with sudo")
        obj_path = paths.bpf_object(OBJ_NAME)
        if not obj_path.exists():
            raise AggregateError(paths.hint(obj_path))
        if not self.fns:
            raise AggregateError("no --fn given: name a function or a glob (--fn 'cuMemAlloc*')")
        self.sites = plan(self.pid, self.lib_name, self.fns)
        try:
            self._load_and_attach()
        except BaseException:
            self.close()
            raise
        self.started_at = time.monotonic()
        self.ended_at = 0.0

    def modes(self) -> list[str]:
        """Ways to probe, best first: 'count' (entry only), 'session' (one
        program at entry and return on a uprobe session link, 6.12+),
        'pair' (entry uprobe + uretprobe, the entry time in task storage);
        each as uprobe_multi links where the kernel has them."""
        if not self.latency:
            return ["count"]

        # A session link is a uprobe_multi link of another attach type.
        session = uprobe_multi() and not os.environ.get("GPUFAULT_NO_UPROBE_SESSION")
        return ["session", "pair"] if session else ["pair"]

    def _load_and_attach(self) -> None:
        # (mode, uprobe_multi links?) to try in turn: sessions exist only
        # as multi links; the others fall back to per-site links.
        multi = uprobe_multi()
        ways = [
            (mode, m)
            for mode in self.modes()
            for m in ((True,) if mode == "session" else (True, False) if multi else (False,))
        ]
        err: BaseException | None = None
        for mode, m in ways:
            try:
                self.obj = self._open_and_load(mode, m)
                self.mode, self.multi = mode, m
                self._attach_all()
                return
            except BpfError as e:
                # This kernel takes the programs another way (an older one
                # has no sessions; one may refuse a program as a uprobe_multi
                # one): the next way, after undoing this one.
                err = e
                self.close()
        raise AggregateError(f"{err}: see `gpufault doctor`") from None

    def _open_and_load(self, mode: str, multi: bool) -> Object:
        obj = Object(paths.bpf_object(OBJ_NAME))
        try:
            want = MODE_PROGS[mode]
            for p in PROGS:
                obj.set_autoload(p, p in want)
            obj.set_rodata(
                {"target_tgid": ("=I", self.pid), "per_thread": ("=B", int(self.per_thread))}
            )
            obj.set_max_entries("stats", max(1, len(self.sites)))
            # Unused unless per thread: keep it small.
            obj.set_max_entries("tstats", MAX_THREAD_KEYS if self.per_thread else 1)
            if multi:
                kind = BPF_TRACE_UPROBE_SESSION if mode == "session" else BPF_TRACE_UPROBE_MULTI
                for p in want:
                    obj.set_expected_attach_type(p, kind)
            obj.load()
        except BaseException:
            obj.close()
            raise
        return obj

    def _attach_all(self) -> None:
        # The return probe first: a call entering between the two attaches
        # then has a return with no pushed entry (ignored), never an entry
        # whose return is not seen (a stale slot on the thread's stack).
        order = {
            "count": [("agg_count", False)],
            "session": [("agg_session", False)],
            "pair": [("agg_return", True), ("agg_entry", False)],
        }[self.mode]
        for prog, is_ret in order:
            self._attach(prog, is_ret)

    def _attach(self, prog: str, is_ret: bool) -> None:
        assert self.obj is not None
        path = self.sites[0].lib.path
        offs = [s.sym.offset for s in self.sites]
        cks = [abi.cookie(s.rule.mode, s.func) for s in self.sites]
        kind = BPF_TRACE_UPROBE_SESSION if self.mode == "session" else BPF_TRACE_UPROBE_MULTI

        # A target whose main thread exited (pthread_exit) while others run:
        # the kernel's pid filter goes through the exited leader's mm and
        # never matches; the programs' own target_tgid check keeps its calls.
        live = live_tid(self.pid)
        pid = self.pid if live is None or live == self.pid else -1
        if not self.multi:
            for s, off, ck in zip(self.sites, offs, cks, strict=True):
                try:
                    self.obj.attach_uprobe(prog, pid, path, off, ck, is_ret)
                except BpfError as e:
                    raise BpfError(e.errno, f"{e} ({s.sym.name})") from None
            return
        try:
            self.obj.attach_uprobe_multi(prog, pid, path, offs, cks, is_ret, kind)
        except BpfError:
            # Name the site the kernel refused: try them one at a time.
            for s, off, ck in zip(self.sites, offs, cks, strict=True):
                try:
                    self.obj.attach_uprobe_multi(prog, pid, path, [off], [ck], is_ret, kind)
                except BpfError as one:
                    raise BpfError(one.errno, f"{one} ({s.sym.name})") from None
            raise

    # ---- results ----------------------------------------------------------
    def read(self) -> Summary:
        """The maps now, summed over CPUs, as a Summary."""
        assert self.obj is not None, "start() first"
        ncpu = _num_cpus()
        per_cpu = abi.AggStats * ncpu
        by_func = {s.func: s for s in self.sites}
        rows: list[tuple[Site, int | None, Any]] = []
        if self.per_thread:
            fd = self.obj.map_fd("tstats")
            for k in _keys(fd, abi.AggKey):
                vals = per_cpu()
                if k.func in by_func and map_lookup(fd, k, vals):
                    rows.append((by_func[k.func], int(k.tid), vals))
        else:
            fd = self.obj.map_fd("stats")
            for s in self.sites:
                vals = per_cpu()
                if map_lookup(fd, C.c_uint32(s.func), vals):
                    rows.append((s, None, vals))
        errs: dict[tuple[int, int | None], dict[int, int]] = {}
        efd = self.obj.map_fd("errs")
        for k in _keys(efd, abi.AggErrKey):
            cnt = (C.c_uint64 * ncpu)()
            if map_lookup(efd, k, cnt):
                key = (int(k.func), int(k.tid) if self.per_thread else None)
                d = errs.setdefault(key, {})
                d[int(k.ret)] = d.get(int(k.ret), 0) + sum(cnt)
        out = []
        for site, tid, vals in rows:
            hist = [sum(v.hist[i] for v in vals) for i in range(abi.SLOTS)]
            f = FuncSummary(
                site.func,
                site.sym.name,
                site.lib.display,
                tid,
                rule=site.rule,
                aliases=list(site.sym.aliases),
            )
            out.append(
                from_counts(
                    f,
                    calls=sum(v.calls for v in vals),
                    returns=sum(hist),  # every return with a latency is in one bucket
                    errors=sum(v.errors for v in vals),
                    errors_by_value=errs.get((site.func, tid), {}),
                    lat_sum=sum(v.lat_sum for v in vals),
                    lat_max=max(v.lat_max for v in vals),
                    hist=hist,
                )
            )
        out.sort(key=lambda f: (-f.calls, f.function, f.tid or 0))
        end = self.ended_at or time.monotonic()
        return Summary(
            None,
            "kernel",
            self.per_thread,
            out,
            duration_s=round(end - self.started_at, 3) if self.started_at else None,
            notes=self._notes(ncpu),
            probes=PROBE_NAMES[self.mode] + (", uprobe_multi links" if self.multi else ""),
        )

    def misc(self, ncpu: int | None = None) -> dict[str, int]:
        """What could not be measured, by reason (aggregate.h enum agg_misc)."""
        assert self.obj is not None
        n = ncpu or _num_cpus()
        fd = self.obj.map_fd("misc")
        out = {}
        for i, name in enumerate(abi.MISC_NAMES):
            cnt = (C.c_uint64 * n)()
            out[name] = sum(cnt) if map_lookup(fd, C.c_uint32(i), cnt) else 0
        return out

    def _notes(self, ncpu: int) -> list[str]:
        why = {
            "no_task_storage": "calls without a latency (no task storage)",
            "nested_too_deep": f"returns nested deeper than {abi.DEPTH}: no latency",
            "unmatched_return": "returns that did not match their entry (longjmp?)",
            "map_full": "per-thread or error-code entries not kept (map full)",
        }
        return [f"{v:,} {why[k]}" for k, v in self.misc(ncpu).items() if v]

    # ---- tear-down --------------------------------------------------------
    def close(self) -> None:
        if self.started_at and not self.ended_at:
            self.ended_at = time.monotonic()
        obj, self.obj = self.obj, None
        if obj is not None:
            obj.close()

    def detach(self) -> None:
        """Stop counting but keep the maps readable (read() after this)."""
        if self.obj is not None:
            self.obj.detach_all()
            if self.started_at and not self.ended_at:
                self.ended_at = time.monotonic()

    def __enter__(self) -> Aggregator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run(
    agg: Aggregator,
    duration: float = 0.0,
    *,
    on_start: Callable[[Aggregator], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> Summary:
    """Start, count until --duration, Ctrl-C/SIGTERM or the target's exit,
    detach, read, close: the summary. Nothing is left attached on any path."""
    stop = False

    def request_stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    # From before the start: a Ctrl-C during attach still ends in close().
    old = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        agg.start()
        try:
            if on_start is not None:
                on_start(agg)
            t0 = time.monotonic()
            while not stop:
                if duration and time.monotonic() - t0 >= duration:
                    break
                if not resolve.pid_alive(agg.pid):
                    if on_notice is not None:
                        on_notice(f"pid {agg.pid} exited")
                    break
                # Nothing to drain (the maps are read once, at the end): the
                # deadline, Ctrl-C/SIGTERM and the target's exit are each
                # seen within 0.1 s (sleep resumes after a signal handler).
                left = t0 + duration - time.monotonic() if duration else 0.1
                time.sleep(min(0.1, max(0.0, left)))
            agg.detach()
            return agg.read()
        finally:
            agg.close()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
