"""The words a front end prints about a run, computed where they are known:
a function's readable name, whether the catalog says it returns void, and
what the kernel's loss counters mean. Light on purpose: each loads its
module on first use, so the `trace` start path pays for none of them."""

from __future__ import annotations

from typing import Any


def demangle(name: str) -> str:
    """A C++ (or Rust) symbol as a reader writes it; other names as they are."""
    # lazy: pyctl.symbols.demangle (ctypes, +5 modules) only when this runs
    from pyctl.symbols.demangle import demangle as _demangle

    return _demangle(name)


def returns_void(function: str) -> bool:
    """Does the catalog say `function` returns void? (False without a catalog.)"""
    try:
        # lazy: the catalog is optional: without one nothing is known to return void
        from pyctl import catalog

        info = catalog.lookup(function)
    except Exception:  # noqa: BLE001 - the catalog is optional
        return False
    return info is not None and info.ret_kind.split(":", 1)[-1].strip() == "void"


def loss_words(causes: dict[str, Any] | None) -> str:
    """The run's loss causes (engine stats) in words; '' when none."""
    # lazy: pyctl.evidence.words (ast, copy, +40 modules, ~200 ms) only when this runs
    from pyctl.evidence.words import loss_words as _loss_words

    return _loss_words(causes)


__all__ = ["demangle", "loss_words", "returns_void"]
