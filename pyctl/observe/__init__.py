"""gpufault seen from outside: its own Prometheus metrics, alert state read
back from Prometheus, Grafana annotations and OpenTelemetry spans of an
experiment (docs/observability.md). The report lives in pyctl/report/."""

from __future__ import annotations

from pyctl.exceptions import BadInput


class ObserveError(BadInput):
    """One line for the user: what went wrong and what to do (exit 2)."""
