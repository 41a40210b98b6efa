"""Placeholders in an experiment file: `{knob}` values, filled in when the
file is loaded, and the target's facts (`{url}`, `{pid}`, ...), known only
once the target runs and filled in then (docs/experiments.md, "The file").

A placeholder alone ("{rate}", "{pid}") keeps its value's type; inside a
longer string it becomes text ("{url}/health"). Names that are neither a
knob nor a fact are refused at load, so this module never guesses.
"""

from __future__ import annotations

import os
import re
from typing import Any

# Facts of the target known only once it runs; probes and commands may use them.
# A multi-rank target (the ready file's `ranks`, the service's `--ranks 2`)
# adds rankN_pid and rankN_tid (that rank's process and its gf-worker).
TARGET_FACTS = ("url", "host", "port", "pid", "worker_tid", "ready_file", "rank1_pid", "rank1_tid")
RANK_FACT = re.compile(r"rank\d+_(pid|tid)")
PLACEHOLDER = re.compile(r"\{(\w+)\}")
# Facts that name a process or a thread: what a step's pid / tid may be.
PID_FACTS = re.compile(r"pid|worker_tid|rank\d+_(pid|tid)")


def is_fact(name: str) -> bool:
    return name in TARGET_FACTS or RANK_FACT.fullmatch(name) is not None


def render(v: Any, vals: dict[str, Any]) -> Any:
    """Values into strings, like templates: "{k}" alone keeps the type.
    Names not in vals are left for later (a knob's pass leaves the facts)."""
    if isinstance(v, dict):
        return {k: render(x, vals) for k, x in v.items()}
    if isinstance(v, list):
        return [render(x, vals) for x in v]
    if isinstance(v, tuple):
        return tuple(render(x, vals) for x in v)
    if isinstance(v, bytes):
        out = render(v.decode(errors="surrogateescape"), vals)
        return str(out).encode(errors="surrogateescape")
    if not isinstance(v, str):
        return v
    m = PLACEHOLDER.fullmatch(v)
    if m and m.group(1) in vals:
        return vals[m.group(1)]
    return PLACEHOLDER.sub(
        lambda mm: str(vals[mm.group(1)]) if mm.group(1) in vals else mm.group(0), v
    )


def render_facts(v: Any, facts: dict[str, Any]) -> Any:
    return render(v, {k: x for k, x in facts.items() if is_fact(k) and x is not None})


def placeholders(v: Any) -> set[str]:
    if isinstance(v, dict):
        return set().union(*(placeholders(x) for x in v.values())) if v else set()
    if isinstance(v, list):
        return set().union(*(placeholders(x) for x in v)) if v else set()
    return set(PLACEHOLDER.findall(v)) if isinstance(v, str) else set()


def stand_ins(v: Any) -> dict[str, Any]:
    """Facts of the right type for checking a table at load, before the
    target runs: a reachable-looking URL, this process as every pid."""
    me = os.getpid()
    out: dict[str, Any] = {
        "url": "http://127.0.0.1:1",
        "host": "127.0.0.1",
        "port": 1,
        "pid": me,
        "worker_tid": me,
    }
    out.update({ph: me for ph in placeholders(v) if RANK_FACT.fullmatch(ph)})
    return out


__all__ = [
    "TARGET_FACTS",
    "is_fact",
    "placeholders",
    "render",
    "render_facts",
    "stand_ins",
]
