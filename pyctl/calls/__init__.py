"""Calls: the per-function aggregates and trace summaries."""
