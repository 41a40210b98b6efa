"""Fault templates: named, versioned TOML files that expand into FaultSpecs.

A template (pyctl/templates/NAME.toml, or a directory in GPUFAULT_TEMPLATES)
holds name, version, class (of ../shared/TEMPLATES.md), title, description,
watch (what to look at while it runs), `[knobs.NAME]` tables with a default
and a help line, and one or more `[[fault]]` tables with the fields of
`gpufault inject` (lib, fn, action, ret, mode, signal, corrupt, stall, nth,
every, after, max, prob, sticky, when, window, trace, no_stack). A field
value "{knob}" takes the knob's value with its type; other strings are
formatted with the knobs ("arg2>={min_bytes}"). docs/templates.md lists them.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyctl.exceptions import BadInput

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (Ubuntu 22.04): the same parser as a package
    import tomli as tomllib

from pyctl.spec import FIELDS, FaultSpec, SpecError, parse_int

HERE = Path(__file__).resolve().parent
ENV_DIRS = "GPUFAULT_TEMPLATES"
FAULT_FIELDS = FIELDS  # a [[fault]] table's fields: FaultSpec.from_fields's
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class TemplateError(BadInput):
    """One line for the user: which template, what is wrong, what to do."""


@dataclass(frozen=True)
class Knob:
    name: str
    default: Any
    help: str

    def coerce(self, text: str) -> Any:
        """A --set value, typed like the default."""
        d = self.default
        if isinstance(d, bool):
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise TemplateError(f"--set {self.name}={text}: use true or false")
        if isinstance(d, int):
            try:
                return parse_int(text, f"--set {self.name}")
            except SpecError as e:
                raise TemplateError(str(e)) from None
        if isinstance(d, float):
            try:
                return float(text)
            except ValueError:
                raise TemplateError(f"--set {self.name}={text}: not a number") from None
        return text


@dataclass
class Template:
    name: str
    version: int
    klass: int
    title: str
    description: str
    watch: str
    knobs: dict[str, Knob]
    faults: list[dict[str, Any]]
    path: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ident(self) -> str:
        return f"{self.name}@v{self.version}"

    def values(self, overrides: dict[str, str] | None = None) -> dict[str, Any]:
        vals = {k: kn.default for k, kn in self.knobs.items()}
        for k, text in (overrides or {}).items():
            if k not in self.knobs:
                known = ", ".join(self.knobs) or "none"
                raise TemplateError(f"{self.name}: no knob {k!r} (knobs: {known})")
            vals[k] = self.knobs[k].coerce(text)
        return vals

    def specs(self, overrides: dict[str, str] | None = None) -> list[FaultSpec]:
        """Expand with the defaults and overrides; raises TemplateError."""
        vals = self.values(overrides)
        out = []
        for i, f in enumerate(self.faults):
            rendered = {k: _render(v, vals) for k, v in f.items()}
            if rendered.pop("enabled", True) in (False, "false", 0):
                continue
            try:
                out.append(build_spec(rendered))
            except (SpecError, ValueError) as e:
                raise TemplateError(f"{self.name}: fault {i + 1}: {e}") from None
        if not out:
            raise TemplateError(f"{self.name}: every fault is disabled by the knobs")
        return out


def _render(v: Any, vals: dict[str, Any]) -> Any:
    if not isinstance(v, str):
        return v
    m = _PLACEHOLDER.fullmatch(v)
    if m:
        return vals[m.group(1)]
    return _PLACEHOLDER.sub(lambda mm: str(vals[mm.group(1)]), v)


def build_spec(f: dict[str, Any]) -> FaultSpec:
    """One [[fault]] table (knobs already rendered) -> a validated FaultSpec,
    through the one spec builder (FaultSpec.from_fields) that `gpufault
    inject` uses, so a field and its option read the same."""
    return FaultSpec.from_fields(f)


def search_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get(ENV_DIRS, "").split(os.pathsep) if p]
    return [*extra, HERE]


def load_file(path: Path) -> Template:
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise TemplateError(f"{path}: not a readable TOML template ({e})") from None
    where = path.name
    for key, typ in (("name", str), ("version", int), ("class", int), ("title", str),
                     ("description", str)):
        if not isinstance(doc.get(key), typ):
            raise TemplateError(f"{where}: needs {key} ({typ.__name__})")
    if doc["name"] != path.stem:
        raise TemplateError(f"{where}: name {doc['name']!r} must match the file name")
    knobs = {}
    for k, spec in (doc.get("knobs") or {}).items():
        if not isinstance(spec, dict) or "default" not in spec or not spec.get("help"):
            raise TemplateError(f"{where}: knob {k} needs a default and a help line")
        knobs[k] = Knob(k, spec["default"], spec["help"])
    faults = doc.get("fault")
    if not isinstance(faults, list) or not faults:
        raise TemplateError(f"{where}: needs at least one [[fault]]")
    for f in faults:
        for v in f.values():
            for name in _PLACEHOLDER.findall(v) if isinstance(v, str) else ():
                if name not in knobs:
                    raise TemplateError(f"{where}: {{{name}}} used but no [knobs.{name}]")
    rest = {k: v for k, v in doc.items() if k not in
            ("name", "version", "class", "title", "description", "watch", "knobs", "fault")}
    return Template(doc["name"], doc["version"], doc["class"], doc["title"],
                    doc["description"].strip(), str(doc.get("watch", "")).strip(), knobs,
                    faults, path, rest)


def all_templates() -> dict[str, Template]:
    """Every template, first directory wins (GPUFAULT_TEMPLATES overrides)."""
    out: dict[str, Template] = {}
    for d in search_dirs():
        for p in sorted(d.glob("*.toml")):
            if p.stem not in out:
                out[p.stem] = load_file(p)
    return out


def get(name: str) -> Template:
    ident = name.split("@v", 1)
    for d in search_dirs():
        p = d / f"{ident[0]}.toml"
        if p.exists():
            t = load_file(p)
            if len(ident) == 2 and str(t.version) != ident[1]:
                raise TemplateError(f"template {t.name} is version {t.version}, not {ident[1]}")
            return t
    names = ", ".join(sorted(all_templates())) or "none"
    raise TemplateError(f"no template {name!r}: see `gpufault template list` ({names})")


__all__ = ["Template", "TemplateError", "Knob", "all_templates", "get", "build_spec"]
