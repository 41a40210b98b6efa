"""Trace summaries: per function, the call count, errors by code name,
latency percentiles and a log2 histogram (bcc's funccount + funclatency).

Two sources fill the same `Summary`:

- `from_calls(db, run_id)`: a recorded run's per-call rows (the `calls`
  table: one row per call, exact latencies, so exact percentiles);
- `from_counts(...)`: the in-kernel maps of pyctl/calls/aggregate.py (counts and
  log2 buckets only, so percentiles are bucket upper bounds, marked
  `exact: false`).

Errors: only a function the catalog knows (pyctl/catalog: CUresult,
ncclResult_t, cublasStatus_t, cufftResult) has a rule for what an error
return is (pyctl/catalog/rules.py): a non-zero 32-bit result code, named
from the catalog's code table. Any other function's return value is not
classified (an int -1, a pointer and a count look alike in a register),
and says so.

A library with no click: pyctl/cli/calls.py is the command line.
"""

from __future__ import annotations

import bisect
import json
import math
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyctl.bpf.aggregate_abi import ERR_NONE, SLOTS
from pyctl.catalog.rules import ErrorRule, error_rule
from pyctl.evidence.words import alias_note
from pyctl.exceptions import BadInput

# The per-call rows' kinds (bpf/gpufault.h enum gf_event_kind): a completed
# call (latency and return), an entry only. Follow rows (3) are links.
EV_CALL, EV_ENTRY = 1, 2
WIDTH = 80


class SummaryError(BadInput):
    """One-line, user-facing (no such run, not a gpufault database)."""


# ---- numbers ----------------------------------------------------------------
def log2_slot(ns: int) -> int:
    """The histogram slot of a latency, as bpf/aggregate.bpf.c computes it:
    floor(log2(ns)), 0 for 0 and 1, the last slot open-ended."""
    return min(max(int(ns), 1).bit_length() - 1, SLOTS - 1)


def slot_bounds(slot: int) -> tuple[int, int | None]:
    """[lo, hi] in ns of a slot; hi None for the open-ended last one."""
    lo = 0 if slot == 0 else 1 << slot
    return lo, (None if slot == SLOTS - 1 else (1 << (slot + 1)) - 1)


def hist_of_sorted(sorted_values: Sequence[int]) -> list[int]:
    """The log2 histogram of sorted values, slot by slot with bisect."""
    edges = [0, 2] + [1 << k for k in range(2, SLOTS)]  # slot k starts at edges[k]
    at = [bisect.bisect_left(sorted_values, e) for e in edges] + [len(sorted_values)]
    return [at[k + 1] - at[k] for k in range(SLOTS)]


def percentile(sorted_values: Sequence[int], p: float) -> int:
    """Nearest-rank percentile: the smallest value with at least p % of the
    values at or below it (numpy's method='inverted_cdf')."""
    if not sorted_values:
        raise ValueError("no values")
    k = max(1, math.ceil(p / 100 * len(sorted_values)))
    return int(sorted_values[min(k, len(sorted_values)) - 1])


def percentile_from_hist(hist: Sequence[int], p: float, vmax: int) -> int:
    """The upper bound of the slot holding the nearest-rank percentile,
    never above the exact maximum: an upper bound on the true value."""
    n = sum(hist)
    if not n:
        raise ValueError("empty histogram")
    k = max(1, math.ceil(p / 100 * n))
    seen = 0
    for slot, c in enumerate(hist):
        seen += c
        if seen >= k:
            hi = slot_bounds(slot)[1]
            return vmax if hi is None else min(hi, vmax)
    return vmax


@dataclass
class Latency:
    count: int
    p50: int
    p90: int
    p99: int
    max: int
    mean: float
    exact: bool  # False: percentiles are log2-bucket upper bounds

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "p50": self.p50,
            "p90": self.p90,
            "p99": self.p99,
            "max": self.max,
            "mean": round(self.mean, 1),
            "exact": self.exact,
        }


@dataclass
class FuncSummary:
    func: int
    function: str
    library: str
    tid: int | None  # per-thread summaries only
    calls: int = 0
    returns: int = 0  # calls whose return value was seen
    rule: ErrorRule = field(default_factory=ErrorRule)
    errors: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    latency: Latency | None = None
    hist: list[int] = field(default_factory=lambda: [0] * SLOTS)
    # The function's other names at its address (function is the canonical
    # one: pyctl/symbols/names.py), e.g. cuMemAlloc beside cuMemAlloc_v2.
    aliases: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        # Errors are known only for a classified function whose returns were
        # seen (count-only probes see none).
        classified = self.rule.mode != ERR_NONE and self.returns > 0
        return {
            "func": self.func,
            "function": self.function,
            "aliases": list(self.aliases),
            "library": self.library,
            "tid": self.tid,
            "calls": self.calls,
            "returns": self.returns,
            "error_rule": self.rule.name,
            "errors": self.errors if classified else None,
            "errors_by_code": dict(self.errors_by_code) if classified else None,
            "latency_ns": self.latency.to_json() if self.latency else None,
            "hist_log2_ns": [
                {"lo": lo, "hi": hi, "count": c}
                for slot, c in enumerate(self.hist)
                if c
                for lo, hi in [slot_bounds(slot)]
            ],
        }


@dataclass
class Summary:
    run_id: str | None
    source: str  # "calls": per-call rows; "kernel": in-kernel maps
    per_thread: bool
    functions: list[FuncSummary]
    duration_s: float | None = None
    notes: list[str] = field(default_factory=list)
    probes: str = ""  # in-kernel source: how calls were probed

    @property
    def calls(self) -> int:
        return sum(f.calls for f in self.functions)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "source": self.source,
            "per_thread": self.per_thread,
            "duration_s": self.duration_s,
            "calls": self.calls,
            "functions": [f.to_json() for f in self.functions],
            "notes": list(self.notes),
            "probes": self.probes or None,
        }

    def render(self, width: int = WIDTH) -> str:
        return render(self, width)


# ---- building summaries -------------------------------------------------------
def _sorted(funcs: Iterable[FuncSummary]) -> list[FuncSummary]:
    # Most-called first, as funccount prints them.
    return sorted(funcs, key=lambda f: (-f.calls, f.function, f.tid or 0, f.func))


def finish_latency(f: FuncSummary, lat_sum: int, lat_max: int) -> None:
    """Fill f.latency from its histogram (in-kernel source)."""
    n = sum(f.hist)
    if not n:
        return
    f.latency = Latency(
        count=n,
        p50=percentile_from_hist(f.hist, 50, lat_max),
        p90=percentile_from_hist(f.hist, 90, lat_max),
        p99=percentile_from_hist(f.hist, 99, lat_max),
        max=lat_max,
        mean=lat_sum / n,
        exact=False,
    )


def from_counts(
    f: FuncSummary,
    *,
    calls: int,
    returns: int,
    errors: int,
    errors_by_value: dict[int, int],
    lat_sum: int,
    lat_max: int,
    hist: Sequence[int],
) -> FuncSummary:
    """Fill one function's summary from in-kernel counters (f carries the
    identity and rule). Error returns the by-value map missed (it was
    full) show as 'other'."""
    f.calls, f.returns = calls, returns
    f.hist = list(hist) + [0] * (SLOTS - len(hist))
    if f.rule.mode != ERR_NONE:
        f.errors = errors
        named = 0
        for v, c in sorted(errors_by_value.items(), key=lambda kv: -kv[1]):
            name = f.rule.code_name(v)
            f.errors_by_code[name] = f.errors_by_code.get(name, 0) + c
            named += c
        if errors > named:
            f.errors_by_code["other"] = errors - named
    finish_latency(f, lat_sum, lat_max)
    return f


def resolve_run(db: Any, run: str) -> str:
    """A run id, or 'last' (the newest run)."""
    if run == "last":
        row = db.conn.execute("SELECT run_id FROM runs ORDER BY started DESC LIMIT 1").fetchone()
        if row is None:
            raise SummaryError("no run recorded yet: run gpufault trace first")
        return str(row[0])
    row = db.conn.execute("SELECT run_id FROM runs WHERE run_id = ?", (run,)).fetchone()
    if row is None:
        raise SummaryError(
            f"no run {run!r} in this database: give a run id (the `run ...` line of "
            "trace, `gpufault faults`) or `last`"
        )
    return str(row[0])


def _aliases(text: Any) -> list[str]:
    """funcs.aliases (JSON, NULL in files older than schema 4) as a list."""
    if not text:
        return []
    try:
        got = json.loads(text)
    except ValueError:
        return []
    return [str(a) for a in got] if isinstance(got, list) else []


def from_calls(db: Any, run_id: str, *, per_thread: bool = False) -> Summary:
    """The summary of one recorded run from its per-call rows: exact
    latencies (completed calls: entry + return rows), errors from every
    row whose return is known (completed calls, and entry rows of calls a
    fault failed, whose value is the injected one)."""
    run_id = resolve_run(db, run_id)
    funcs = {
        int(r[0]): (str(r[1] or ""), str(r[2] or ""), r[3])
        for r in db.conn.execute(
            "SELECT func, symbol, library, aliases FROM funcs WHERE run_id = ? ORDER BY func",
            (run_id,),
        )
    }
    rules: dict[int, ErrorRule] = {}
    out: dict[tuple[int, int | None], FuncSummary] = {}

    def get(func: int, tid: int | None) -> FuncSummary:
        key = (func, tid)
        f = out.get(key)
        if f is None:
            sym, lib, aliases = funcs.get(func, (f"func#{func}", "", None))
            if func not in rules:
                rules[func] = error_rule(sym, lib)
            f = out[key] = FuncSummary(
                func, sym, lib, tid, rule=rules[func], aliases=_aliases(aliases)
            )
        return f

    if not per_thread:  # every probed function, called or not (funccount shows zeros)
        for func in funcs:
            get(func, None)
    # Counting and grouping run in SQLite, and the latencies come back as one
    # string per function (parsed at C speed), so no Python runs per row:
    # about 3 s per million rows on the 2-core dev VM, SQLite's scan most of it.
    tid_col = "tid" if per_thread else "NULL"
    known = f"(kind = {EV_CALL} OR (kind = {EV_ENTRY} AND fault_id IS NOT NULL))"
    for func, tid, n, n_known in db.conn.execute(
        f"SELECT func, {tid_col}, count(*), sum({known} AND ret IS NOT NULL) FROM calls "
        f"WHERE run_id = ? AND kind IN ({EV_CALL}, {EV_ENTRY}) GROUP BY 1, 2",
        (run_id,),
    ):
        f = get(int(func), None if tid is None else int(tid))
        f.calls, f.returns = int(n), int(n_known or 0)
    ruled = sorted({k[0] for k in out if rules[k[0]].mode != ERR_NONE})
    if ruled:
        # The rule reads the low 32 bits (an int result code in a 64-bit register).
        for func, tid, code, n in db.conn.execute(
            f"SELECT func, {tid_col}, ret & 4294967295, count(*) FROM calls "
            f"WHERE run_id = ? AND {known} AND ret IS NOT NULL AND ret & 4294967295 != 0 "
            f"AND func IN ({','.join('?' * len(ruled))}) GROUP BY 1, 2, 3",
            (run_id, *ruled),
        ):
            f = get(int(func), None if tid is None else int(tid))
            f.errors += int(n)
            name = f.rule.code_name(int(code))
            f.errors_by_code[name] = f.errors_by_code.get(name, 0) + int(n)
    for func, tid, text in db.conn.execute(
        f"SELECT func, {tid_col}, group_concat(coalesce(latency_ns, 0)) FROM calls "
        f"WHERE run_id = ? AND kind = {EV_CALL} GROUP BY 1, 2",
        (run_id,),
    ):
        f = get(int(func), None if tid is None else int(tid))
        vals = sorted(map(int, text.split(",")))
        f.hist = hist_of_sorted(vals)
        f.latency = Latency(
            count=len(vals),
            p50=percentile(vals, 50),
            p90=percentile(vals, 90),
            p99=percentile(vals, 99),
            max=vals[-1],
            mean=sum(vals) / len(vals),
            exact=True,
        )
    for f in out.values():
        f.errors_by_code = dict(sorted(f.errors_by_code.items(), key=lambda kv: -kv[1]))
    row = db.conn.execute("SELECT started, ended FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    dur = (row[1] - row[0]) if row and row[0] is not None and row[1] is not None else None
    return Summary(run_id, "calls", per_thread, _sorted(out.values()), dur)


# ---- text ---------------------------------------------------------------------
def fmt_ns(ns: float) -> str:
    """812ns, 1.2us, 3.4ms, 1.23s."""
    if ns < 1_000:
        return f"{ns:.0f}ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.1f}us"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.1f}ms"
    return f"{ns / 1e9:.2f}s"


def render_hist(hist: Sequence[int], width: int = WIDTH, unit: str = "nsecs") -> list[str]:
    """bcc's log2 histogram, from the first to the last non-empty slot:

    nsecs             : count     distribution
      256 -> 511      : 8        |****************************************|
    """
    used = [i for i, c in enumerate(hist) if c]
    if not used:
        return []
    lo_s, hi_s = used[0], used[-1]
    rows = []
    for s in range(lo_s, hi_s + 1):
        lo, hi = slot_bounds(s)
        rows.append((str(lo), "inf" if hi is None else str(hi), hist[s]))
    w = max(max(len(a) for a, _, _ in rows), max(len(b) for _, b, _ in rows), 5)
    cw = max(8, max(len(str(c)) for _, _, c in rows))
    fixed = w + 4 + w + 3 + cw + 1 + 2
    bar = max(10, min(40, width - fixed - 1))
    top = max(c for _, _, c in rows)
    # The label column spans "lo -> hi", as in bcc's.
    out = [f"{unit:>{w}}{'':{w + 4}} : {'count':<{cw}} distribution"]
    for a, b, c in rows:
        stars = "*" * (round(c * bar / top) if top else 0)
        if c and not stars:
            stars = "*"  # a non-empty slot is never drawn empty
        out.append(f"{a:>{w}} -> {b:<{w}} : {c:<{cw}} |{stars:<{bar}}|")
    return out


def _errors_lines(f: FuncSummary, width: int) -> list[str]:
    """'  calls N   errors E' and the codes under it, wrapped to width."""
    head = f"  calls {f.calls:,}   "
    if f.rule.mode == ERR_NONE or not f.returns:  # not classified, or no return seen
        return [head + "errors -"]
    if not f.errors:
        return [head + "errors 0"]
    codes = ", ".join(f"{k} {v:,}" for k, v in f.errors_by_code.items())
    return [
        head + f"errors {f.errors:,}:",
        *textwrap.wrap(codes, width, initial_indent="    ", subsequent_indent="    "),
    ]


def render(s: Summary, width: int = WIDTH) -> str:
    what = "per-call rows" if s.source == "calls" else "in-kernel counts"
    head = f"run {s.run_id}: " if s.run_id else ""
    dur = f" in {s.duration_s:.1f}s" if s.duration_s else ""
    n = len({f.func for f in s.functions})
    out = [f"{head}{s.calls:,} calls to {n} function{'s' if n != 1 else ''}{dur} ({what})"]
    idle = [f for f in s.functions if not f.calls]
    for f in s.functions:
        if not f.calls:
            continue  # listed together below, as funccount leaves them out
        out.append("")
        lib = f.library.rsplit("/", 1)[-1]
        who = f"  tid {f.tid}" if f.tid is not None else ""
        head_line = f"{f.function}{alias_note(f.aliases)}  ({lib}){who}"
        # Cut, it says so (a demangled C++ name is often longer than a line).
        out.append(head_line if len(head_line) <= width else head_line[: width - 1] + "\u2026")
        out.extend(_errors_lines(f, width))
        if f.latency is not None:
            L = f.latency
            le = "" if L.exact else "<="
            out.append(
                f"  latency p50 {le}{fmt_ns(L.p50)}  p90 {le}{fmt_ns(L.p90)}  "
                f"p99 {le}{fmt_ns(L.p99)}  max {fmt_ns(L.max)}  mean {fmt_ns(L.mean)}"
            )
            out.extend("  " + ln for ln in render_hist(f.hist, width - 2))
        else:
            out.append("  latency -  (entry only: no return probe)")
    if idle:
        names = ", ".join(sorted({f.function for f in idle}))
        out.append("")
        out.extend(
            textwrap.wrap(
                f"not called: {names}",
                width,
                subsequent_indent="  ",
                max_lines=4,
                placeholder=f" ... ({len(idle)} in all)",
            )
        )
    if s.source == "kernel" and any(f.latency for f in s.functions):
        out.append("")
        out.append("percentiles marked <= are the upper bounds of their log2 buckets")
    if s.probes:
        out.append(f"probes: {s.probes}")
    for note in s.notes:
        out.append(f"note: {note}")
    return "\n".join(out)
