"""The shipped fault templates (pyctl/templates: named, versioned TOML
files of faults with knobs): list them, read one, expand its faults with
knob values. `Fault.from_template(name, **knobs)` is the short way to its
specs; this module is what `gpufault template list|show` reads.

Template, TemplateError, get, all_templates and search_dirs are
pyctl.templates' own, loaded on first use (PEP 562): `import gpufault`
pays for none of it (~40 ms: the TOML reader, the spec builder).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyctl.templates import Template, TemplateError, all_templates, get, search_dirs

_LAZY = ("Template", "TemplateError", "all_templates", "get", "search_dirs")


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pyctl.api.templates' has no attribute {name!r}")
    value = getattr(importlib.import_module("pyctl.templates"), name)
    globals()[name] = value
    return value


def names() -> list[str]:
    """Every template file's name (GPUFAULT_TEMPLATES first), by file name:
    none is parsed, so a malformed one is still listed."""
    # lazy: pyctl.templates (tomllib, the spec builder, ~40 ms) only when this runs
    from pyctl.templates import search_dirs

    return sorted({p.stem for d in search_dirs() for p in d.glob("*.toml")})


__all__ = ["Template", "TemplateError", "all_templates", "get", "names", "search_dirs"]
