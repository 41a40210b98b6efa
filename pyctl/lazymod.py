"""A module imported when first used, for the few a trace's way to its
first call names but does not call: the store (sqlite3, json, hashlib and
the schema: ~8-12 ms of imports on the 2-vCPU dev VM) is opened only after
an early trace's probes are in (pyctl/early.py). Type checkers see the
real module (the TYPE_CHECKING import beside each use)."""

from __future__ import annotations

import importlib
from typing import Any


class OnFirstUse:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"
