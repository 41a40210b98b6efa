"""The test doubles shipped with gpufault (built by `make build`, in the
wheel too): a CPU libcuda with the real soname and exports, and gf-infer,
an inference-loop workload linked against it. What `gpufault demo` and a
user's first test run on a host without a GPU."""

from __future__ import annotations

from pathlib import Path

from pyctl import paths
from pyctl.exceptions import MissingPrerequisite

DOUBLE_LIBCUDA = paths.DOUBLE_LIBCUDA
DOUBLE_INFER = paths.DOUBLE_INFER


def require(*files: Path) -> None:
    """MissingPrerequisite, naming what builds it, for the first file absent."""
    for p in paths.missing(*files):
        raise MissingPrerequisite(paths.hint(p))


__all__ = ["DOUBLE_INFER", "DOUBLE_LIBCUDA", "require"]
