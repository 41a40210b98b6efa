"""Names gpufault shows for a fault, shared by the metrics' labels and the
report: a symbol demangled and shortened, a return code's catalog name.
Light on purpose (no prometheus_client): the report and the CLI import it."""

from __future__ import annotations

import re
from typing import Any


def short_function(name: str, limit: int = 64) -> str:
    """A readable, bounded name for a symbol: demangled, generic arguments
    dropped, the last two path segments. A Rust v0 symbol of the tokenizer
    (300 characters mangled) reads `TokenizerImpl::encode_char_offsets`;
    a C name is itself."""
    # lazy: pyctl.symbols.demangle (ctypes, +5 modules) only when this runs
    from pyctl.symbols.demangle import demangle

    text = demangle(name)
    if text == name and "::" not in name:
        return name if len(name) <= limit else name[: limit - 1] + "…"
    prev = None
    while prev != text:  # generic arguments (Type<...>, ::<...>), innermost first
        prev = text
        text = re.sub(r"(?:(?<=\w)|::)<[^<>]*>", "", text)
    text = text.replace("<", "").replace(">", "")  # what is left: <Type as Trait>
    parts = [p for p in re.split(r"::", text.replace(" as ", "::")) if p.strip()]
    out = "::".join(p.strip() for p in parts[-2:]) or name
    return out if len(out) <= limit else out[: limit - 1] + "…"


def fire_code(row: dict[str, Any]) -> str:
    """The `code` label of a fire: the injected return value's name
    (CUDA_ERROR_OUT_OF_MEMORY) where the catalog knows the library, else its
    number; for actions that return nothing (stall, signal, corrupt,
    observe) the action's name."""
    retval = row.get("retval")
    if retval is None:
        return str(row.get("action") or "none")
    try:
        # lazy: the catalog is optional: without it a code stays a number
        from pyctl.catalog.codes import code_name
        from pyctl.catalog.libraries import lib_for_soname

        lib = lib_for_soname(str(row.get("library") or ""))
        name = code_name(lib, int(retval)) if lib else None
    except (ValueError, KeyError, ImportError):
        name = None
    return name or str(retval)
