"""`import gpufault`: the library under the tool's name. The session API
(pyctl.api) and, a layer above it, experiments (pyctl.experiment.public)."""

from pyctl.api import *  # noqa: F403 - the public surface, listed in pyctl.api.__all__
from pyctl.api import __all__ as _api
from pyctl.experiment.public import ExperimentVerdict, load_experiment, run_experiment

__all__ = [*_api, "run_experiment", "load_experiment", "ExperimentVerdict"]
