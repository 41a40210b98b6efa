"""Experiment reports: one self-contained HTML file (inline CSS and SVG)
and a Markdown version, from the evidence store (docs/observability.md)."""

from __future__ import annotations

from pyctl.report.data import ReportError
from pyctl.report.html import render_html
from pyctl.report.markdown import render_markdown

__all__ = ["ReportError", "render_html", "render_markdown"]
