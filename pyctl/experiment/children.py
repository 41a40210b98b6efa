"""How the experiment layer starts a child of gpufault: isolated
(`python -I -m pyctl ...`), with the environment it needs. Below the
steps and the target, which both start children."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pyctl import paths

_REPO = str(Path(__file__).resolve().parent.parent.parent)  # the checkout: pyctl/..


def child_argv(args: list[str], python: str = sys.executable) -> list[str]:
    """`python -m pyctl ARGS`, isolated (pyctl.paths.module_argv: never a
    module from the cwd or PYTHONPATH), dying with SIGTERM when this
    process dies."""
    return paths.module_argv("pyctl", args, die_with=os.getpid(), python=python)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: ours, unbuffered. PYTHONPATH names this
    checkout first for a target.command that runs `python -m pyctl...`
    itself (gpufault's own children are isolated and ignore it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH", "")) if p)
    return env
