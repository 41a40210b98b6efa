"""`gpufault experiment report ID... -o FILE.html [--markdown FILE.md]`.

The lead attaches `report` under the `experiment` group
(`experiment.add_command(report)`); it opens the store read-only, like
`faults` and `show`, and writes each file whole (renamed into place).
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from pyctl.api.reading import open_readonly
from pyctl.cli.options import db_option
from pyctl.report import ReportError
from pyctl.report import html as html_report
from pyctl.report import markdown as md_report
from pyctl.report.data import load
from pyctl.report.exploremap import ExploreMap, load_map


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise ReportError(f"{path}: {e.strerror or e}; pick another -o/--markdown path") from None


@click.command("report")
@click.argument("experiment_ids", metavar="ID...", nargs=-1, required=True)
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="the HTML file to write (self-contained)",
)
@click.option(
    "--markdown",
    "markdown",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="also write a Markdown version here",
)
@click.option("--title", default=None, help="the report's title")
@db_option()
def report(
    experiment_ids: tuple[str, ...],
    output: Path,
    markdown: Path | None,
    title: str | None,
    db_path: str,
) -> None:
    """Write a report of one or more experiments: per experiment a timeline
    (latency, errors, fault windows, fault IDs, Xids, anchors), the
    hypothesis before/during/after, the statistics, the recovery time and
    each fault's evidence chain; across them the verification matrix.

    An ID may be an exploration's (`gpufault explore run`): its resilience
    map comes first, and every trial's experiment is reported after it.

    \b
    Examples:
      gpufault experiment report x1a2b3c4 -o report.html --db gf.db
      gpufault experiment report e0d7194f3 -o map.html --markdown map.md --db gf.db
    """
    for p in (output, markdown):
        if p is not None and not p.parent.is_dir():
            raise ReportError(f"{p.parent}: no such directory; create it or pick another path")
    db = open_readonly(db_path)
    maps: list[ExploreMap] = []
    try:
        ids: list[str] = []
        for i in experiment_ids:
            m = load_map(db, i)
            if m is None:
                ids.append(i)
            else:  # an exploration: its map, then its trials' experiments
                maps.append(m)
                ids += m.experiment_ids
        datas = [load(db, i) for i in dict.fromkeys(ids)]
    finally:
        db.close()
    _write(output, html_report.render_datas(datas, title, maps))
    if markdown is not None:
        _write(markdown, md_report.render_datas(datas, title, maps))
    verdicts = ", ".join(f"{d.name} {d.exp.get('verdict') or '?'}" for d in datas)
    click.echo(
        f"report of {len(datas)} experiment(s) ({verdicts}): {output}"
        + (f" and {markdown}" if markdown else "")
    )
