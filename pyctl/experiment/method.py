"""The method: [[method]] tables into Steps, in order, with their timing.

What every step has (name, start, duration, parallel, and its aim: thread,
pid, tid, arm_timeout) is read here; what a kind's own table says is read
by that kind (pyctl/experiment/steps/, found by its word: template or
fault, traffic, perturb, pressure). A step starts where the previous one
ended, or with it (parallel = true), or at its own `start`.
"""

from __future__ import annotations

from typing import Any

from pyctl.experiment.facts import PID_FACTS, PLACEHOLDER
from pyctl.experiment.model import Step
from pyctl.experiment.reader import Reader
from pyctl.experiment.steps import WORDS

COMMON = {
    "name", "set", "start", "duration", "parallel", "thread", "pid", "tid", "arm_timeout", "agent",
}  # fmt: skip


def parse_method(r: Reader, doc: dict[str, Any]) -> list[Step]:
    raw = doc.get("method", [])
    if not isinstance(raw, list) or not all(isinstance(x, dict) for x in raw):
        raise r.err("method", "expected [[method]] tables (one per fault step)")
    steps: list[Step] = []
    prev_start, prev_end = 0.0, 0.0
    for i, m in enumerate(raw):
        key = f"method[{i + 1}]"
        r.keys(m, key, COMMON | set(WORDS))
        chosen = [w for w in WORDS if w in m]
        if len(chosen) != 1:
            raise r.err(
                key,
                'give exactly one of template = "NAME", fault = {lib=..., ...}, '
                'traffic = {corpus = "...", rate = ...}, perturb = {rules = [...]} '
                "or pressure = {share = 0.9}",
            )
        duration = r.duration(m, key, "duration")
        parallel = r.bool_(m, key, "parallel", False)
        if "start" in m:
            start = r.duration(m, key, "start", allow_zero=True)
        else:
            start = prev_start if parallel else prev_end
        thread = r.str_(m, key, "thread", "") or None
        pid, tid = _who(r, m, key, "pid"), _who(r, m, key, "tid")
        if tid is not None and thread is not None:
            raise r.err(f"{key}.tid", "tid and thread both name the thread: keep one")
        arm_timeout = r.duration(m, key, "arm_timeout") if "arm_timeout" in m else None
        agent, agent_select = _agent(r, m, key)
        kind = WORDS[chosen[0]]
        kind.refuse(r, key, m)
        common = Step(
            idx=i,
            name="",
            template=None,
            sets={},
            fault=None,
            start=start,
            duration=duration,
            thread=thread,
            pid=pid,
            tid=tid,
            arm_timeout=arm_timeout,
            kind=kind.name,
            agent=agent,
            agent_select=agent_select,
        )
        steps.append(kind.parse(r, key, m, common))
        prev_start, prev_end = start, start + duration
    return steps


def _agent(r: Reader, m: dict[str, Any], key: str) -> tuple[str | None, dict[str, Any] | None]:
    """agent = "NAME" (one of the file's [agents.NAME]), or a selector
    {node = "gpu-7"} / {labels = {rank = "1"}}: the agent whose node says
    so of itself when the run starts (pyctl/experiment/agents.py)."""
    v = m.get("agent")
    if v is None or isinstance(v, str):
        return (v or None), None
    k = f"{key}.agent"
    if not isinstance(v, dict) or not v:
        raise r.err(k, 'expected a name, or {node = "NODE"} or {labels = {KEY = "VALUE"}}')
    r.keys(v, k, {"node", "labels"})
    sel: dict[str, Any] = {}
    if "node" in v:
        sel["node"] = r.str_(v, k, "node")
    if "labels" in v:
        sel["labels"] = agent_labels(r, v["labels"], f"{k}.labels")
    return None, sel


def agent_labels(r: Reader, v: Any, key: str) -> dict[str, str]:
    """{KEY = "VALUE", ...}: strings, as the agent's --label KEY=VALUE."""
    if not isinstance(v, dict) or not v:
        raise r.err(key, 'expected a table of strings: labels = {rank = "1"}')
    for lk, lv in v.items():
        if not isinstance(lv, str):
            raise r.err(f"{key}.{lk}", f"{lv!r}: a label's value is a string")
    return dict(v)


def _who(r: Reader, m: dict[str, Any], key: str, name: str) -> str | None:
    """A step's pid or tid: a number, or one fact naming a process or thread
    ("{rank1_pid}", "{worker_tid}"), filled in when the target runs."""
    if name not in m:
        return None
    v = m[name]
    k = f"{key}.{name}"
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 1:
            raise r.err(k, f"{v} is not a process id: give one >= 1")
        return str(v)
    if isinstance(v, str):
        ph = PLACEHOLDER.fullmatch(v.strip())
        if ph and PID_FACTS.fullmatch(ph.group(1)):
            return v.strip()
        if v.strip().isdigit() and int(v) >= 1:
            return v.strip()
    raise r.err(
        k,
        f'{v!r}: give a number or one fact such as "{{rank1_pid}}" '
        '("{pid}", "{worker_tid}", "{rankN_pid}", "{rankN_tid}")',
    )


__all__ = ["parse_method"]
