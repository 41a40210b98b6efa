"""`gpufault evidence merge|pull`: several nodes' (ranks', agents')
databases into one store (pyctl/api/evidence.py merge_evidence; pyctl/
evidence/merge.py says what is merged and when it is refused), or each
agent's store pulled over its link first (pyctl/agent/pull.py)."""

from __future__ import annotations

import click

from pyctl.cli.agent import auth_options
from pyctl.cli.base import user_errors


@click.group("evidence")
def evidence() -> None:
    """Evidence stores: merge several nodes' databases into one, or pull
    them from their agents."""


@evidence.command("merge")
@click.argument("sources", nargs=-1, metavar="DB...", type=click.Path(dir_okay=False))
@click.option("--into", "into", required=True, type=click.Path(dir_okay=False),
              help="the merged database (created if missing; its own runs stay)")  # fmt: skip
@click.option("--skip-running", is_flag=True,
              help="leave out runs a source still has running (a live store)")  # fmt: skip
@user_errors
def merge(sources: tuple[str, ...], into: str, skip_running: bool) -> None:
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

    for st in merge_evidence(list(sources), into, skip_running=skip_running):
        click.echo(st.line())


@evidence.command("pull")
@click.argument("agents", nargs=-1, metavar="URL...")
@click.option("--into", "into", required=True, type=click.Path(dir_okay=False),
              help="the local database the agents' runs are merged into")  # fmt: skip
@auth_options
@user_errors
def pull(agents: tuple[str, ...], into: str, token_file: str | None, cert: str | None,
         key: str | None, ca: str | None, server_name: str | None) -> None:  # fmt: skip
    """Pull each agent's evidence store and merge it into --into.

    Each agent sends a consistent snapshot of its store over its
    authenticated link (checked by size and sha256); the snapshots are
    merged in one transaction like `evidence merge`. Runs an agent still
    has running are left out: pull again when they end (what came before
    is skipped as the same).

    \b
    Example:
      gpufault evidence pull tls://node7:7450 tls://node8:7450 \\
          --ca ca.pem --token-file agent.token --into fleet.db
    """
    # lazy: keeps pyctl.agent (ssl, sockets) off `--help`
    from pyctl.agent.pull import pull_evidence

    for p in pull_evidence(list(agents), into, token_file=token_file, cert=cert, key=key,
                           ca=ca, server_hostname=server_name):  # fmt: skip
        click.echo(p.line())
