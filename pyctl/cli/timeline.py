"""`gpufault timeline RUN`: a run's faults, links, Xids and anchors in time
order (pyctl/api/reading.py: pyctl/evidence/timeline.py builds and renders;
read-only, as `show`)."""

from __future__ import annotations

import json

import click

from pyctl.cli.base import on_terminal, open_existing, user_errors
from pyctl.cli.options import db_option, json_option


@click.command()
@click.argument("run", metavar="RUN|EXPERIMENT|latest", default="latest")
@db_option()
@json_option
@user_errors
def timeline(run: str, db_path: str, as_json: bool) -> None:
    """What happened, in time order: faults, what followed them (error
    returns, signals, exits), Xids and anchors, from the run's start.

    RUN is a run id, `latest` (the default) or an experiment id (every
    step's run, timed from the experiment's start). One line an event,
    80 columns on a terminal, whole into a file or a pipe; --json has
    every field.

    \b
    Examples:
      gpufault timeline
      gpufault timeline 1a2b3c4d
      gpufault timeline x1a2b3c4 --json
    """
    # lazy: pyctl.api.reading (+1 module) only when this runs
    from pyctl.api import reading

    db = open_existing(db_path)
    doc = reading.timeline(db, run)  # BadInput: one line (user_errors)
    if as_json:
        click.echo(json.dumps(doc.to_json(), indent=2))
    else:
        click.echo(reading.render_timeline(doc, cut=on_terminal()))
