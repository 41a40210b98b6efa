"""`gpufault evidence merge`: several nodes' (ranks', agents') databases
into one store (pyctl/api/evidence.py merge_evidence; pyctl/evidence/
merge.py says what is merged and when it is refused)."""

from __future__ import annotations

import click

from pyctl.cli.base import user_errors


@click.group("evidence")
def evidence() -> None:
    """Evidence stores: merge several nodes' databases into one."""


@evidence.command("merge")
@click.argument("sources", nargs=-1, metavar="DB...", type=click.Path(dir_okay=False))
@click.option("--into", "into", required=True, type=click.Path(dir_okay=False),
              help="the merged database (created if missing; its own runs stay)")  # fmt: skip
@user_errors
def merge(sources: tuple[str, ...], into: str) -> None:
    """Merge the runs and experiments of each DB into --into.

    Each run and experiment once: one already there, the same, is skipped
    (merging twice adds nothing); another under the same id is refused
    with --into untouched. `faults`, `show`, `timeline` and `experiment
    report` then read every node's evidence from one file.

    \b
    Example:
      gpufault evidence merge node-a.db node-b.db --into fleet.db
    """
    # lazy: pyctl.api.evidence's merge only when this runs
    from pyctl.api.evidence import merge_evidence

    for st in merge_evidence(list(sources), into):
        click.echo(st.line())
