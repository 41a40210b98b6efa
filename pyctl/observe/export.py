"""An experiment's record to the tools SREs watch, after it ran: its
spans as OTLP (a collector's OTLP/HTTP endpoint, or an OTLP JSON file)
and its steps as Grafana annotations (the API, and/or a JSON file).
What `gpufault experiment run --otlp-... --grafana-...` and `gpufault
experiment export ID ...` do; each line says what went where."""

from __future__ import annotations

import os
from typing import Any

from pyctl.observe import ObserveError


def export(
    db: Any,
    experiment_id: str,
    *,
    otlp_file: str | os.PathLike[str] | None = None,
    otlp_endpoint: str | None = None,
    otlp_headers: dict[str, str] | None = None,
    grafana_url: str | None = None,
    grafana_token: str | None = None,
    annotations_file: str | os.PathLike[str] | None = None,
) -> list[str]:
    """db: an open store (read-only is enough). ObserveError: one line."""
    lines: list[str] = []
    if otlp_file or otlp_endpoint:
        # lazy: opentelemetry (+37 modules) only when spans are asked for
        from pyctl.observe import otel

        if otlp_endpoint:
            docs = otel.export_experiment(db, experiment_id, endpoint=otlp_endpoint,
                                          headers=otlp_headers)  # fmt: skip
            lines.append(f"otlp: {len(docs)} spans sent to {otel.traces_url(otlp_endpoint)}")
        if otlp_file:
            docs = otel.export_experiment(db, experiment_id, json_path=otlp_file)
            lines.append(f"otlp: {len(docs)} spans written to {otlp_file} (OTLP JSON)")
    if grafana_url or annotations_file:
        # lazy: pyctl.observe.grafana (urllib) only when annotations are asked for
        from pyctl.observe import grafana

        if grafana_url and not grafana_token:
            raise ObserveError("--grafana-url needs --grafana-token-file (a service account "
                               "token with annotations:write)")  # fmt: skip
        anns = grafana.publish(db, experiment_id, annotations_file, grafana_url=grafana_url,
                               token=grafana_token)  # fmt: skip
        if grafana_url:
            lines.append(f"grafana: {len(anns)} annotations posted to {grafana_url}")
        if annotations_file:
            lines.append(f"grafana: {len(anns)} annotations written to {annotations_file}")
    return lines


__all__ = ["export"]
