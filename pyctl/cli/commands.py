"""Every command and group of `gpufault`, registered explicitly.

A new command group is one line in COMMANDS: "module:attribute". A module
that fails to import is an error at start-up (and in the tests' walk over
every command), never a group that silently disappears.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import click

from pyctl.cli import completion
from pyctl.cli.root import cli

COMMANDS = (
    "pyctl.cli.doctor:doctor",
    "pyctl.cli.doctor:probes",
    "pyctl.cli.trace:trace",
    "pyctl.cli.calls:calls",
    "pyctl.cli.inject:inject",
    "pyctl.cli.inject:release",
    "pyctl.cli.show:faults",
    "pyctl.cli.show:show",
    "pyctl.cli.timeline:timeline",
    "pyctl.cli.demo:demo",
    "pyctl.cli.template:template",
    "pyctl.cli.hooks:hooks_group",
    "pyctl.cli.netchaos:netchaos_group",
    "pyctl.cli.anchors:anchors",
    "pyctl.cli.serve:serve",
    "pyctl.cli.agent:agent",
    "pyctl.cli.tokenizer:tokenizer",
    "pyctl.cli.service:service",
    "pyctl.cli.experiment:experiment",
    "pyctl.cli.explore:explore_group",
    "pyctl.cli.evidence:evidence",
)

# Groups whose sub-commands take a NAME of one of our files: their `name`
# argument completes those names unless it completes something already, so
# a group living elsewhere (pyctl/cli/experiment.py) completes without
# importing completion.py itself.
NAME_COMPLETION = {
    "experiment": completion.experiment_names,
    "template": completion.template_names,
}


def _complete_names(cmd: click.Command) -> None:
    complete = NAME_COMPLETION.get(cmd.name or "")
    if complete is None or not isinstance(cmd, click.Group):
        return
    for sub in cmd.commands.values():
        for p in sub.params:
            # click keeps shell_complete= here (no public setter); None: not given.
            if isinstance(p, click.Argument) and p.name == "name":
                if getattr(p, "_custom_shell_complete", False) is None:
                    p._custom_shell_complete = complete


def add(group: click.Group, cmd: click.Command) -> None:
    _complete_names(cmd)
    group.add_command(cmd)


def register(group: click.Group = cli, names: Sequence[str] = COMMANDS) -> None:
    for ref in names:
        module, attr = ref.split(":")
        add(group, getattr(importlib.import_module(module), attr))


register()
