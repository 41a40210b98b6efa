"""The values every front end reads one way (the spec builder's own
parsers, pyctl/spec.py): durations, integers and sizes, probabilities,
signals and return codes; and where the evidence goes by default.

    parse_duration("1m30s", "--duration")  -> 90.0
    parse_code("CUDA_ERROR_OUT_OF_MEMORY", "--ret")
    DEFAULT_DB                             -> /var/lib/gpufault/gpufault.db

Each raises SpecError (a BadInput) whose text names `what` and the fix.
Light: the spec module only, as the command line's start path already has.
"""

from __future__ import annotations

from pyctl.evidence.store import DEFAULT_DB
from pyctl.spec import (
    STACK_COPY_MAX,
    ReturnCode,
    SpecError,
    catalog_library,
    check_stack_copy,
    parse_code,
    parse_duration,
    parse_int,
    parse_prob,
    parse_signal,
)


def code_names(lib: str = "cuda") -> list[str]:
    """The return-code names the catalog knows for `lib` (a catalog library
    or a name that maps to one: libcuda, nccl); [] without a catalog."""
    try:
        # lazy: the catalog is optional: without one there are no names ([])
        from pyctl.catalog.libraries import library

        return sorted(set(library(catalog_library(lib)).codes.values()))
    except Exception:  # noqa: BLE001 - the catalog is optional
        return []


__all__ = [
    "DEFAULT_DB",
    "STACK_COPY_MAX",
    "check_stack_copy",
    "ReturnCode",
    "SpecError",
    "catalog_library",
    "code_names",
    "parse_code",
    "parse_duration",
    "parse_int",
    "parse_prob",
    "parse_signal",
]
