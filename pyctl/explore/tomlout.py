"""A small TOML writer for the experiment files explore generates: tables,
arrays of tables, strings, numbers, booleans, inline lists and tables
(the shapes an experiment file has). No writer ships with Python."""

from __future__ import annotations

import json
import re
from typing import Any

_BARE = re.compile(r"[A-Za-z0-9_-]+")


def _key(k: str) -> str:
    return k if _BARE.fullmatch(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _emit(out: list[str], doc: dict[str, Any], prefix: str, inline: bool = False) -> None:
    """inline: an array-of-tables item, whose table values stay inline
    (`fault = { lib = ..., fn = ... }`, as the shipped files write them)."""
    tables = []
    for k, v in doc.items():
        if not inline and isinstance(v, dict) or _is_table_array(v):
            tables.append((k, v))
        else:
            out.append(f"{_key(k)} = {_value(v)}")
    for k, v in tables:
        name = f"{prefix}{_key(k)}"
        if isinstance(v, dict):
            out.append("")
            out.append(f"[{name}]")
            _emit(out, v, name + ".")
        else:
            for item in v:
                out.append("")
                out.append(f"[[{name}]]")
                _emit(out, item, name + ".", inline=True)


def dumps(doc: dict[str, Any], header: str = "") -> str:
    """doc as TOML text; header: comment lines put first."""
    out = [f"# {line}" if line else "#" for line in header.splitlines()]
    _emit(out, doc, "")
    return "\n".join(out).strip("\n") + "\n"
