"""`gpufault tokenizer ...`: the tokenizer campaigns (classes 9-12).

The lead registers the group with `cli.add_command(tokenizer)`. Every
command is thin: it resolves the target, opens the campaign's run, runs
the campaign (all through pyctl/api/tokenizer.py) and prints a summary
table (or JSON with --json).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from pyctl.api import tokenizer as T
from pyctl.api.errors import BadInput, MissingPrerequisite
from pyctl.cli.options import DURATION, db_option

TARGET_HELP = (
    "hf | tiktoken (built in-process from generated data), module:callable, "
    'or http://host:port/path (POST {"text"} -> {"ids"})'
)


def common(f: Callable[..., Any]) -> Callable[..., Any]:
    """Options every campaign takes."""

    @click.option("--target", "target_spec", default="hf", show_default=True, help=TARGET_HELP)
    @db_option(path_type=Path)  # the same --db as every command (gpufault --db, GPUFAULT_DB)
    @click.option("--no-db", is_flag=True, help="do not store results")
    @click.option("--keep-text", is_flag=True, help="store input text (default: hash + length)")
    @click.option("--json", "as_json", is_flag=True, help="print a JSON summary instead of a table")
    @click.option("--strict", is_flag=True, help="exit 1 when the campaign finds anything")
    @click.option("--seed", default=1, show_default=True, help="random seed")
    @functools.wraps(f)
    def wrapper(*args: Any, **kw: Any) -> Any:
        return f(*args, **kw)

    return wrapper


def _resolve(spec: str, **kw: Any) -> Any:
    try:
        return T.resolve_target(spec, **kw)
    except (ValueError, TypeError, ImportError) as e:
        raise click.BadParameter(str(e), param_hint="--target") from e


def _run(
    campaign: str,
    db_path: Path | None,
    no_db: bool,
    keep_text: bool,
    target: Any = None,
    function: str = "encode",
) -> T.Campaign:
    """The campaign's run (pyctl.api.tokenizer.Campaign): `with` it for
    the Recorder; findings become faults rows of the run."""
    try:
        return T.campaign(
            campaign,
            db_path,
            no_db=no_db,
            keep_text=keep_text,
            target=target,
            function=function,
            argv=sys.argv,
        )
    except MissingPrerequisite as e:
        raise click.ClickException(str(e)) from e


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _emit(as_json: bool, summary: dict[str, Any], table: str, found: bool, strict: bool) -> None:
    if as_json:
        click.echo(json.dumps(summary, indent=2, sort_keys=True, default=str))
    else:
        click.echo(table)
    if strict and found:
        sys.exit(1)


@click.group("tokenizer")
def tokenizer() -> None:
    """Tokenizer fault campaigns: Unicode/BPE depth, truncation, races, caches.

    \b
    Examples:
      gpufault tokenizer fuzz --target tiktoken
      gpufault tokenizer race --target hf --threads 8 --stall-us 200
      gpufault tokenizer cache --target hf --cache-capacity 0
      gpufault tokenizer truncation --target hf --corrupt mask-flip
      gpufault tokenizer fuzz --target http://127.0.0.1:8080/tokenize
      gpufault tokenizer probes
      gpufault tokenizer observe --pid 1234 --duration 5s
    """


@tokenizer.command()
@common
@click.option("--category", "categories", multiple=True, help="only these categories (repeat)")
@click.option("--max-len", default=100_000, show_default=True, help="length of the long cases")
@click.option(
    "--slow-factor",
    default=20.0,
    show_default=True,
    help="flag cases whose cost per char exceeds this x the median",
)
@click.option("--weaken", is_flag=True, help="wrap the target in WeakLossyTokenizer (demo)")
def fuzz(
    target_spec: str,
    db_path: Path | None,
    no_db: bool,
    keep_text: bool,
    as_json: bool,
    strict: bool,
    seed: int,
    categories: tuple[str, ...],
    max_len: int,
    slow_factor: float,
    weaken: bool,
) -> None:
    """Class 9: adversarial Unicode and deep-BPE inputs through a tokenizer.

    \b
    Example:
      gpufault tokenizer fuzz --target tiktoken --max-len 20000
    """
    target = _resolve(target_spec)
    if weaken:
        target = T.weaken(target, "fuzz")
    try:
        cases = T.fuzz_cases(target.specials, max_len=max_len, categories=categories or None)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--category") from e
    with _run("fuzz", db_path, no_db, keep_text, target) as rec:
        with click.progressbar(length=len(cases), label="fuzz", file=sys.stderr) as bar:
            rep = T.run_fuzz(
                target, cases, recorder=rec, slow_factor=slow_factor, progress=bar.update
            )
    outcomes = sorted({o.outcome for o in rep.outcomes} | {"slow"})
    rows = [
        [cat] + [counts.get(k, 0) for k in outcomes] for cat, counts in rep.by_category().items()
    ]
    table = _table(["category"] + outcomes, rows)
    found = rep.findings
    table += f"\n{len(found)} finding(s) in {len(rep.outcomes)} cases against {rep.target}"
    for o in found[:10]:
        table += f"\n  {o.fault_id or '-'} {o.case.category}/{o.case.name}: {o.outcome}"
        table += f"{' (slow)' if o.slow else ''} {o.error[:60]}"
    summary = {
        "campaign": "fuzz",
        "target": rep.target,
        "cases": len(rep.outcomes),
        "by_category": rep.by_category(),
        "median_ns_per_char": rep.median_ns_per_char,
        "findings": [
            {
                "fault_id": o.fault_id,
                "category": o.case.category,
                "case": o.case.name,
                "outcome": o.outcome,
                "slow": o.slow,
                "error": o.error,
            }
            for o in found
        ],
    }
    _emit(as_json, summary, table, bool(found), strict)


@tokenizer.command()
@common
@click.option("--threads", default=8, show_default=True, help="threads sharing the tokenizer")
@click.option("--calls", default=200, show_default=True, help="calls per thread")
@click.option(
    "--stall-us",
    default=0,
    show_default=True,
    help="stall odd threads after the inner encode (targets with .inner)",
)
@click.option("--weaken", is_flag=True, help="wrap the target in WeakUnsyncCacheTokenizer (demo)")
def race(
    target_spec: str,
    db_path: Path | None,
    no_db: bool,
    keep_text: bool,
    as_json: bool,
    strict: bool,
    seed: int,
    threads: int,
    calls: int,
    stall_us: int,
    weaken: bool,
) -> None:
    """Class 11: threads share one tokenizer; compare with a 1-thread reference.

    \b
    Example:
      gpufault tokenizer race --target tiktoken --weaken --stall-us 200
    """
    if threads < 2:
        raise click.BadParameter("need at least 2 threads", param_hint="--threads")
    target = _resolve(target_spec)
    if weaken:
        target = T.weaken(target, "race")
    with _run("race", db_path, no_db, keep_text, target) as rec:
        with click.progressbar(length=threads, label="race threads", file=sys.stderr) as bar:
            rep = T.run_race(
                target,
                threads=threads,
                calls_per_thread=calls,
                stall_us=stall_us,
                seed=seed,
                recorder=rec,
                progress=bar.update,
            )
    rows = [
        [rep.fault_ids[i] if rep.fault_ids else "-", i, n] for i, n in sorted(rep.per_input.items())
    ]
    table = _table(["fault_id", "input", "mismatches"], rows) if rows else "no mismatches"
    table += (
        f"\n{rep.target}: {rep.threads} threads, {rep.calls} calls, {rep.errors} errors, "
        f"{len(rep.mismatches)} mismatches in {rep.seconds:.2f} s"
    )
    summary = {
        "campaign": "race",
        "target": rep.target,
        "threads": rep.threads,
        "calls": rep.calls,
        "errors": rep.errors,
        "mismatches": len(rep.mismatches),
        "per_input": rep.per_input,
        "seconds": rep.seconds,
    }
    _emit(as_json, summary, table, bool(rep.mismatches), strict)


@tokenizer.command()
@common
@click.option("--requests", default=1500, show_default=True, help="hot requests per phase")
@click.option("--flood-ratio", default=4, show_default=True, help="cold requests per hot one")
@click.option(
    "--cache-capacity",
    type=int,
    default=None,
    help="hf only: BPE cache capacity (0 = none; default: library default)",
)
@click.option("--factor", default=2.0, show_default=True, help="p50 ratio that counts as skew")
@click.option("--weaken", is_flag=True, help="wrap the target in WeakLruCacheTokenizer (demo)")
def cache(
    target_spec: str,
    db_path: Path | None,
    no_db: bool,
    keep_text: bool,
    as_json: bool,
    strict: bool,
    seed: int,
    requests: int,
    flood_ratio: int,
    cache_capacity: int | None,
    factor: float,
    weaken: bool,
) -> None:
    """Class 12: Zipf hot words plus a cold flood; p50/p99 before, during, after.

    \b
    Example:
      gpufault tokenizer cache --target hf --cache-capacity 100
    """
    if cache_capacity is not None and target_spec != "hf":
        raise click.BadParameter(
            "--cache-capacity applies to --target hf only", param_hint="--cache-capacity"
        )
    target = _resolve(target_spec, cache_capacity=cache_capacity)
    if weaken:
        target = T.weaken(target, "cache")
    with _run("cache", db_path, no_db, keep_text, target) as rec:
        with click.progressbar(length=3 * requests, label="cache", file=sys.stderr) as bar:
            rep = T.run_cache(
                target,
                requests=requests,
                flood_ratio=flood_ratio,
                factor=factor,
                seed=seed,
                recorder=rec,
                progress=bar.update,
            )
    rows = [
        [
            p.phase,
            p.hot_requests,
            f"{p.hot_p50_us:.1f}",
            f"{p.hot_p99_us:.1f}",
            f"{p.hot_per_s:.0f}",
            f"{p.all_per_s:.0f}",
            "-" if p.hit_ratio is None else f"{p.hit_ratio:.2f}",
        ]
        for p in rep.phases
    ]
    table = _table(["phase", "hot", "p50 us", "p99 us", "hot/s", "all/s", "hits"], rows)
    table += (
        f"\n{rep.target}: during/before p50 x{rep.during_ratio:.2f} "
        f"({'POLLUTED' if rep.polluted else 'ok'}), after/before x{rep.after_ratio:.2f} "
        f"({'STICKY' if rep.sticky else 'ok'})"
    )
    summary = {
        "campaign": "cache",
        "target": rep.target,
        "phases": [p.__dict__ for p in rep.phases],
        "during_ratio": rep.during_ratio,
        "after_ratio": rep.after_ratio,
        "polluted": rep.polluted,
        "sticky": rep.sticky,
    }
    _emit(as_json, summary, table, rep.polluted or rep.sticky, strict)


@tokenizer.command()
@common
@click.option("--max-length", default=32, show_default=True, help="the context limit L")
@click.option(
    "--corrupt",
    type=click.Choice(["mask-flip", "mask-shift", "id-to-pad", "id-random"]),
    default=None,
    help="perturb the collated output (in-process hook)",
)
@click.option("--rate", default=0.5, show_default=True, help="share of rows to corrupt")
@click.option("--weaken", is_flag=True, help="collate with WeakOffByOneCollator (demo)")
def truncation(
    target_spec: str,
    db_path: Path | None,
    no_db: bool,
    keep_text: bool,
    as_json: bool,
    strict: bool,
    seed: int,
    max_length: int,
    corrupt: str | None,
    rate: float,
    weaken: bool,
) -> None:
    """Class 10: inputs at the context limit; ids, mask and truncation must agree.

    \b
    Example:
      gpufault tokenizer truncation --target hf --max-length 64 --corrupt mask-flip
    """
    if max_length < 2:
        raise click.BadParameter("must be >= 2", param_hint="--max-length")
    if not 0.0 <= rate <= 1.0:
        raise click.BadParameter("must be in [0, 1]", param_hint="--rate")
    target = _resolve(target_spec)
    if weaken:
        target = T.weaken(target, "truncation")
    with _run("truncation", db_path, no_db, keep_text, target, "collate") as rec:
        with click.progressbar(length=4, label="truncation", file=sys.stderr) as bar:
            rep = T.run_truncation(
                target,
                max_length=max_length,
                corrupt=corrupt,
                rate=rate,
                seed=seed,
                recorder=rec,
                progress=bar.update,
            )
    rows = [
        [v["label"], v["pad_side"], v["truncate_side"], v["violation"][:40]]
        for v in rep.violations[:20]
    ]
    table = _table(["input", "pad", "trunc", "violation"], rows) if rows else "no violations"
    table += (
        f"\n{rep.target}: {rep.rows} rows, {len(rep.violations)} violations, "
        f"{len(rep.warnings)} warnings"
    )
    if corrupt:
        table += f"; injected {rep.injected}, detected {rep.injected_detected}"
    summary = {
        "campaign": "truncation",
        "target": rep.target,
        "rows": rep.rows,
        "violations": rep.violations,
        "warnings": rep.warnings,
        "injected": rep.injected,
        "injected_detected": rep.injected_detected,
    }
    _emit(as_json, summary, table, bool(rep.violations), strict)


@tokenizer.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def probes(as_json: bool) -> None:
    """List the tokenizer entry points found in the installed wheels.

    \b
    Example:
      gpufault tokenizer probes
    """
    reports = T.entry_point_reports()
    if as_json:
        click.echo(json.dumps([T.report_json(r) for r in reports], indent=2))
        return
    for r in reports:
        click.echo(
            f"{r.library}: {r.path or 'not installed'}"
            + (f" ({r.symtab} .symtab, {r.dynsym} .dynsym functions)" if r.path else "")
        )
        for kind, eps in r.found.items():
            for e in eps:
                slow = " SLOW(endbr64)" if e.starts_with_endbr64 else ""
                click.echo(
                    f"  {kind:<24} +{e.file_offset:#x} {e.size:>5}B {_short(e.demangled, 44)}{slow}"
                )
        for kind, why in r.missing.items():
            click.echo(f"  {kind:<24} MISSING: {why[:100]}")
        if r.note:
            click.echo(f"  note: {r.note}")


_short = T.short_name


@tokenizer.command()
@click.option("--pid", type=int, required=True, help="the process to observe (probe-only)")
@click.option(
    "--kind",
    "kinds",
    multiple=True,
    help="entry-point kinds (default: the encode kinds of each library mapped)",
)
@click.option(
    "--duration",
    "--seconds",
    "seconds",
    type=DURATION,
    default="5s",
    show_default=True,
    help="how long to count: 5s, 1m30s, 10 (--seconds: the old name)",
)
def observe(pid: int, kinds: tuple[str, ...], seconds: float) -> None:
    """Probe-only: count encode calls in a running process with tracefs uprobes.

    Counts are per library file (every process mapping it is counted).

    \b
    Example:
      gpufault tokenizer observe --pid 1234 --duration 10s
    """
    try:
        libs = T.libraries_of_pid(pid)
    except BadInput as e:
        raise click.BadParameter(str(e), param_hint="--pid") from e
    if not libs:
        raise click.ClickException(f"process {pid} maps no tokenizers or tiktoken library")
    points = T.entry_points(
        libs, kinds, on_skip=lambda kind, e: click.echo(f"skip {kind}: {e}", err=True)
    )
    if not points:
        raise click.ClickException("no entry points to probe (see gpufault tokenizer probes)")
    click.echo(f"Counting {len(points)} entry points in pid {pid} for {seconds:g} s ...", err=True)
    try:
        hits = T.count_calls(points, seconds)
    except PermissionError as e:
        raise click.ClickException(str(e)) from e
    click.echo(
        _table(
            ["kind", "hits", "function"],
            [[p.kind, hits[i], _short(p.demangled, 50)] for i, p in enumerate(points)],
        )
    )
