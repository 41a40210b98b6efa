"""`import gpufault`: the library API (pyctl.api), under the tool's name."""

from pyctl.api import *  # noqa: F403 - the public surface, listed in pyctl.api.__all__
from pyctl.api import __all__  # noqa: F401
