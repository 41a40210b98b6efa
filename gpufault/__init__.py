"""`import gpufault`: the library under the tool's name. The session API
(pyctl.api) and, layers above it, experiments (pyctl.experiment.public) and
the node agent's server and client (pyctl.agent), and fault-space
exploration (pyctl.explore.public: `explore`, `Exploration`), both loaded
on first use."""

from typing import Any

from pyctl.api import *  # noqa: F403 - the public surface, listed in pyctl.api.__all__
from pyctl.api import __all__ as _api
from pyctl.experiment.public import ExperimentVerdict, load_experiment, run_experiment

# The node agent (issue 28): ssl and its sockets only when a name is used.
_AGENT = ("AgentServer", "AgentClient", "RemoteSession", "AgentError", "AgentRefused",
          "pull_evidence", "Pulled")

# Fault-space exploration (issue 24): its modules (~57 ms) only when used.
_EXPLORE = ("explore", "Exploration")


def __getattr__(name: str) -> Any:
    if name in _EXPLORE:
        import pyctl.explore.public  # lazy: keeps pyctl.explore (~57 ms) off `import gpufault`

        return getattr(pyctl.explore.public, name)
    if name in _AGENT:
        import pyctl.agent

        return getattr(pyctl.agent, name)
    raise AttributeError(f"module 'gpufault' has no attribute {name!r}")


__all__ = [
    *_api,
    "run_experiment",
    "load_experiment",
    "ExperimentVerdict",
    *_EXPLORE,
    *_AGENT,
]
