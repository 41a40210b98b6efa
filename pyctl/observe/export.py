"""An experiment's record to the tools SREs watch, after it ran: its
spans and per-window metrics as OTLP (a collector's OTLP/HTTP endpoint,
or an OTLP JSON Lines file)
and its steps as Grafana annotations (the API, and/or a JSON file).
What `gpufault experiment run --otlp-... --grafana-...` and `gpufault
experiment export ID ...` do; each line says what went where."""

from __future__ import annotations

import json
import os
from pathlib import Path
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
        from pyctl.observe import otel, otlp_metrics

        mdoc = otlp_metrics.build(db, experiment_id)
        npts = otlp_metrics.points(mdoc)
        if otlp_endpoint:
            docs = otel.export_experiment(db, experiment_id, endpoint=otlp_endpoint,
                                          headers=otlp_headers)  # fmt: skip
            lines.append(f"otlp: {len(docs)} spans sent to {otel.traces_url(otlp_endpoint)}")
            otlp_metrics.send(mdoc, otlp_endpoint, headers=otlp_headers)
            lines.append(f"otlp: {npts} metric points sent to "
                         f"{otlp_metrics.metrics_url(otlp_endpoint)}")  # fmt: skip
        if otlp_file:
            # JSON Lines, a request a line (traces, then metrics): what the
            # collector's otlpjsonfile receiver reads and its file exporter writes.
            _, spans = otel.build_spans(db, experiment_id)
            body = json.dumps(otel.otlp_json(spans)) + "\n" + json.dumps(mdoc) + "\n"
            p = Path(otlp_file)
            tmp = p.with_name(p.name + ".tmp")
            tmp.write_text(body)
            os.replace(tmp, p)
            lines.append(f"otlp: {len(spans)} spans and {npts} metric points written to "
                         f"{otlp_file} (OTLP JSON Lines: traces, metrics)")  # fmt: skip
    if grafana_url or annotations_file:
        # lazy: pyctl.observe.grafana (urllib) only when annotations are asked for
        from pyctl.observe import grafana

        if grafana_url and not grafana_token:
            raise ObserveError("--grafana-url needs --grafana-token-file or "
                               "$GPUFAULT_GRAFANA_TOKEN (a service account token with "
                               "annotations:write)")  # fmt: skip
        anns = grafana.publish(db, experiment_id, annotations_file, grafana_url=grafana_url,
                               token=grafana_token)  # fmt: skip
        if grafana_url:
            lines.append(f"grafana: {len(anns)} annotations posted to {grafana_url}")
        if annotations_file:
            lines.append(f"grafana: {len(anns)} annotations written to {annotations_file}")
    return lines


__all__ = ["export"]
