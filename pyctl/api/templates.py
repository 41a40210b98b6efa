"""The shipped fault templates (pyctl/templates: named, versioned TOML
files of faults with knobs): list them, read one, expand its faults with
knob values. `Fault.from_template(name, **knobs)` is the short way to its
specs; this module is what `gpufault template list|show` reads."""

from __future__ import annotations

from pyctl.templates import Template, TemplateError, all_templates, get, search_dirs


def names() -> list[str]:
    """Every template file's name (GPUFAULT_TEMPLATES first), by file name:
    none is parsed, so a malformed one is still listed."""
    return sorted({p.stem for d in search_dirs() for p in d.glob("*.toml")})


__all__ = ["Template", "TemplateError", "all_templates", "get", "names", "search_dirs"]
