"""`gpufault explore discover|plan|run|resume|report|diff`: fault-space
exploration (issue 24, docs/explore.md), a thin front end over
pyctl.explore.public.

Exit status: 0 done, 1 a trial broke the SLO, crashed, hung or did not
recover (the map has findings), 2 bad input (one line, nothing left), 3
interrupted (SIGINT, SIGTERM: the trial in flight is not recorded;
`explore resume ID` runs it again).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import click

from pyctl.api.errors import GpufaultError
from pyctl.cli.base import UserError
from pyctl.cli.options import Duration, db_option
from pyctl.explore import discover as D
from pyctl.explore import plan as P
from pyctl.explore import public as X
from pyctl.explore import report as R

BAD = ("SLO broken", "crashed", "hung", "did not recover")


def _libs(values: tuple[str, ...]) -> dict[str, str] | None:
    """--lib LIB[:FNGLOB] ... -> {lib: glob}; None: the defaults."""
    if not values:
        return None
    out = {}
    for v in values:
        lib, _, fn = v.partition(":") if not v.startswith("/") or ":" in v else (v, "", "")
        out[lib] = fn or D.DEFAULT_LIBS.get(lib, "*")
    return out


def _common(f: Any) -> Any:
    for opt in reversed(
        [
            click.option(
                "--lib",
                "libs",
                multiple=True,
                metavar="LIB[:FN]",
                help="a library to trace and its function glob (repeatable; default: "
                "libcuda:cu*, libcudart:cuda*, libcublas:cublas*, libnccl:nccl*, "
                "tokenizers:tok:hf-encode)",
            ),
            click.option(
                "--discover-for",
                "discover_s",
                type=Duration(),
                default="4s",
                show_default=True,
                help="how long to sample calls under the load",
            ),
            click.option(
                "--cut",
                type=click.IntRange(1, 64),
                default=3,
                show_default=True,
                help="caller frames in a point's stack signature (deeper ones are one point)",
            ),
            click.option(
                "--stall",
                default="200ms",
                show_default=True,
                help="the stall tried at every point (besides the error codes and a hang)",
            ),
            click.option("--no-hang", is_flag=True, help="do not try a hang at each point"),
            click.option(
                "--pins",
                type=click.Path(dir_okay=False, exists=True),
                help="TOML file: pin = [...], exclude = [...], codes = [...]",
            ),
            click.option("--max-runs", type=click.IntRange(0), help="at most this many trials"),
            click.option(
                "--budget", "budget_s", type=Duration(), help="time budget for the trials"
            ),
            click.option(
                "--window",
                "window_s",
                type=Duration(),
                default="2s",
                show_default=True,
                help="each trial's fault window",
            ),
            click.option(
                "--recover",
                type=Duration(),
                default="2s",
                show_default=True,
                help="the SLO must hold again within this long after the fault",
            ),
            click.option(
                "--workdir",
                type=click.Path(file_okay=False),
                help="where the trials' experiment files go (default: DB.explore/ID/)",
            ),
            click.option(
                "--pid",
                type=click.IntRange(1),
                help="explore this running server instead of the file's [target] (with --url)",
            ),
            click.option("--url", help="the running server's base URL (with --pid)"),
            db_option(),
        ]
    ):
        f = opt(f)
    return f


def _target(pid: int | None, url: str | None) -> dict[str, Any] | None:
    """--pid/--url as the [target] table they replace (None: the file's)."""
    if pid is None and url is None:
        return None
    if pid is None or not url:
        raise UserError("--pid and --url go together: give both (a running server and its URL)")
    return {"pid": pid, "url": url}


def _indented(verbose: bool) -> Any:
    """-v: each trial's experiment lines, indented under its trial line."""
    return (lambda s: click.echo("  " + s.replace("\n", "\n  "), err=True)) if verbose else None


def _first_existing(p: Path) -> Path:
    """The nearest of p and its parents that exists now."""
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _clean(wd: Path, had: Path) -> None:
    """Bad input leaves nothing: the folders made for it since `had`."""
    top = wd
    while top.parent != had and top.parent != top:
        top = top.parent
    if top != had and had in top.parents:
        shutil.rmtree(top, ignore_errors=True)


def _echo(quiet: bool) -> Any:
    return None if quiet else (lambda s: click.echo(s, err=True))


def _fail(e: GpufaultError) -> UserError:
    return UserError(str(e))


@click.group("explore")
def explore_group() -> None:
    """Find every fault point a service's requests pass through, inject each, map the outcomes.

    \b
    Examples:
      gpufault explore run svc.toml --db gf.db
      gpufault explore plan svc.toml --lib libcuda --max-runs 10
      gpufault explore resume e1a2b3c4d --db gf.db
      gpufault explore report latest --db gf.db --html map.html
      gpufault explore diff e1a2b3c4d e5f6a7b8c --db gf.db
    """


@explore_group.command("discover")
@click.argument("file", type=click.Path(dir_okay=False, exists=True))
@_common
@click.option("--json", "as_json", is_flag=True, help="print the points as JSON")
def discover_cmd(
    file: str,
    libs: tuple[str, ...],
    discover_s: float,
    cut: int,
    stall: str,
    no_hang: bool,
    pins: str | None,
    max_runs: int | None,
    budget_s: float | None,
    window_s: float,
    recover: float,
    workdir: str | None,
    pid: int | None,
    url: str | None,
    db_path: str,
    as_json: bool,
) -> None:
    """Run FILE's target under its load and list the fault points its calls pass through.

    \b
    Example:
      gpufault explore discover svc.toml --lib libcuda --discover-for 5s
    """
    del pins, max_runs, budget_s, window_s, recover
    wd = Path(workdir) if workdir else Path(db_path + ".explore") / "discover"
    had = _first_existing(wd)
    try:
        d = D.discover(
            file,
            db=db_path,
            libs=_libs(libs),
            window_s=discover_s,
            cut=cut,
            stall=stall,
            hang=not no_hang,
            workdir=wd,
            target=_target(pid, url),
            echo=_echo(as_json),
        )
    except GpufaultError as e:
        _clean(wd, had)
        raise _fail(e) from None
    if as_json:
        click.echo(
            json.dumps(
                {
                    "experiment_id": d.experiment_id,
                    "calls": d.calls,
                    "sampled": d.sampled,
                    "window_s": d.window_s,
                    "points": [p.to_json() for p in d.points],
                },
                indent=1,
            )
        )
        return
    for p in d.points:
        click.echo(
            f"{p.point}  {p.calls:>6}  {p.rate:>7.1f}/s  {p.library.rsplit('/', 1)[-1]}:"
            f"{p.function} @ {R._site(p.site)}  [{', '.join(p.codes)}]"
        )
    click.echo(
        f"{len(d.points)} point(s), {d.sampled} sampled of {d.calls} call(s) in "
        f"{d.window_s:.1f}s (experiment {d.experiment_id})"
    )


@explore_group.command("plan")
@click.argument("file", type=click.Path(dir_okay=False, exists=True))
@_common
def plan_cmd(
    file: str,
    libs: tuple[str, ...],
    discover_s: float,
    cut: int,
    stall: str,
    no_hang: bool,
    pins: str | None,
    max_runs: int | None,
    budget_s: float | None,
    window_s: float,
    recover: float,
    workdir: str | None,
    pid: int | None,
    url: str | None,
    db_path: str,
) -> None:
    """Discover FILE's fault points and print the plan of trials (nothing injected).

    \b
    Example:
      gpufault explore plan svc.toml --pins pins.toml --max-runs 20
    """
    wd = Path(workdir) if workdir else Path(db_path + ".explore") / "plan"
    had = _first_existing(wd)
    try:
        filters = P.read_filters(pins)
        d = D.discover(
            file,
            db=db_path,
            libs=_libs(libs),
            window_s=discover_s,
            cut=cut,
            stall=stall,
            hang=not no_hang,
            workdir=wd,
            target=_target(pid, url),
            echo=None,
        )
    except GpufaultError as e:
        _clean(wd, had)
        raise _fail(e) from None
    trials, notes = P.make_plan(
        d.points, filters, max_runs, budget_s, window_s + recover + 1.0 + 5.0
    )
    click.echo(P.render(trials, {p.point: p for p in d.points}, notes))


def _run(
    file: str,
    libs: tuple[str, ...],
    discover_s: float,
    cut: int,
    stall: str,
    no_hang: bool,
    pins: str | None,
    max_runs: int | None,
    budget_s: float | None,
    window_s: float,
    recover: float,
    workdir: str | None,
    pid: int | None,
    url: str | None,
    db_path: str,
    quiet: bool,
    stop_after: int | None,
    verbose: bool,
) -> X.Exploration:
    try:
        return X.explore(
            file,
            db=db_path,
            libs=_libs(libs),
            discover_s=discover_s,
            window_s=window_s,
            cut=cut,
            stall=stall,
            hang=not no_hang,
            pins=pins,
            max_runs=max_runs,
            budget_s=budget_s,
            recover=f"{recover:g}s",
            workdir=workdir,
            echo=_echo(quiet),
            stop_after=stop_after,
            target=_target(pid, url),
            experiment_echo=_indented(verbose),
        )
    except GpufaultError as e:
        raise _fail(e) from None


def _summary(x: X.Exploration) -> None:
    by: dict[str, int] = {}
    for t in x.trials:
        by[t["outcome"]] = by.get(t["outcome"], 0) + 1
    c = x.coverage
    click.echo(
        f"exploration {x.exploration_id} {x.status}: {c['points_tried']}/"
        f"{c['points_found']} point(s) tried, {c['trials_run']} trial(s): "
        + ", ".join(f"{n} {o}" for o, n in sorted(by.items()))
        + f"; report: gpufault explore report {x.exploration_id} --db {x.db}"
    )
    for n in x.notes:
        click.echo(f"note: {n}")
    if x.status == "interrupted":
        sys.exit(3)
    if any(t["outcome"] in BAD for t in x.trials):
        sys.exit(1)


@explore_group.command("run")
@click.argument("file", type=click.Path(dir_okay=False, exists=True))
@_common
@click.option("-q", "--quiet", is_flag=True, help="only the summary line")
@click.option(
    "--stop-after",
    type=click.IntRange(0),
    help="run at most this many trials now; `explore resume ID` runs the rest",
)
@click.option("-v", "--verbose", is_flag=True, help="also each trial's experiment lines")
def run_cmd(quiet: bool, stop_after: int | None, verbose: bool, **kw: Any) -> None:
    """Discover, plan and run a trial per caller site and fault of FILE's target.

    \b
    Example:
      gpufault explore run svc.toml --db gf.db --max-runs 12
    """
    _summary(_run(quiet=quiet, stop_after=stop_after, verbose=verbose, **kw))


@explore_group.command("resume")
@click.argument("exploration")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False),
    help="where the trials' experiment files go (default: DB.explore/ID/)",
)
@click.option("-q", "--quiet", is_flag=True, help="only the summary line")
@click.option("-v", "--verbose", is_flag=True, help="also each trial's experiment lines")
@db_option()
def resume_cmd(
    exploration: str, workdir: str | None, quiet: bool, verbose: bool, db_path: str
) -> None:
    """Run the trials of EXPLORATION (an id or `latest`) that have not run yet.

    \b
    Example:
      gpufault explore resume e1a2b3c4d --db gf.db
    """
    try:
        x = X.resume(
            exploration,
            db=db_path,
            workdir=workdir,
            echo=_echo(quiet),
            experiment_echo=_indented(verbose),
        )
    except GpufaultError as e:
        raise _fail(e) from None
    _summary(x)


@explore_group.command("report")
@click.argument("exploration", default="latest")
@click.option(
    "--html",
    "html_out",
    type=click.Path(dir_okay=False),
    help="also write the HTML resilience map here",
)
@click.option("--json", "as_json", is_flag=True, help="print the exploration as JSON")
@db_option()
def report_cmd(exploration: str, html_out: str | None, as_json: bool, db_path: str) -> None:
    """Print EXPLORATION's resilience map as Markdown (default: the latest).

    \b
    Example:
      gpufault explore report latest --db gf.db --html map.html
    """
    try:
        doc = X.plan_of(db_path, exploration)
    except GpufaultError as e:
        raise _fail(e) from None
    if html_out:
        Path(html_out).write_text(R.html_report(doc))
    if as_json:
        click.echo(json.dumps({**doc, "coverage": R.coverage(doc)}, indent=1, default=str))
    else:
        click.echo(R.markdown(doc), nl=False)


@explore_group.command("diff")
@click.argument("a")
@click.argument("b")
@db_option()
def diff_cmd(a: str, b: str, db_path: str) -> None:
    """Outcomes that differ between explorations A and B (same function, site and fault).

    A change is WORSE when B's outcome is more severe (tolerated < degraded
    within SLO < SLO broken, did not recover < hung, crashed). Exit status 1
    when B is worse anywhere (a gate for a new build against the old one).

    \b
    Example:
      gpufault explore diff e1a2b3c4d e5f6a7b8c --db gf.db
    """
    try:
        da, db_ = X.plan_of(db_path, a), X.plan_of(db_path, b)
    except GpufaultError as e:
        raise _fail(e) from None
    d = R.diff(da, db_)
    click.echo(R.render_diff(da, db_, d), nl=False)
    if any(r["change"] == "worse" for r in d):
        raise SystemExit(1)
