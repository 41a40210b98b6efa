"""`import gpufault`: the library under the tool's name. The session API
(pyctl.api) and, layers above it, experiments (pyctl.experiment.public) and
the node agent's server and client (pyctl.agent, loaded on first use)."""

from typing import Any

from pyctl.api import *  # noqa: F403 - the public surface, listed in pyctl.api.__all__
from pyctl.api import __all__ as _api
from pyctl.experiment.public import ExperimentVerdict, load_experiment, run_experiment
from pyctl.explore.public import Exploration, explore

# The node agent (issue 28): ssl and its sockets only when a name is used.
_AGENT = ("AgentServer", "AgentClient", "RemoteSession", "AgentError", "AgentRefused")


def __getattr__(name: str) -> Any:
    if name in _AGENT:
        import pyctl.agent

        return getattr(pyctl.agent, name)
    raise AttributeError(f"module 'gpufault' has no attribute {name!r}")


__all__ = [
    *_api,
    "run_experiment",
    "load_experiment",
    "ExperimentVerdict",
    "explore",
    "Exploration",
    *_AGENT,
]
