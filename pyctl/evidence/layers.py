"""Faults of the layers that are not probes: tokenizer campaigns, the
in-process hooks (VRAM pressure, Tensor Core bit flips, the LD_PRELOAD
shim) and netchaos windows, as rows of the same `runs` / `specs` /
`faults` tables the BPF engine writes, so `gpufault faults` and
`gpufault show` know them.

Such a fault has no probed function of a library, no registers and no
stack: `function` names the entry point or the knob (`encode`,
`cuMemAlloc_v2`, `vram`, `veth a2b`), `mechanism` says which layer
carried it out (LAYER_MECHANISMS), and `outcome` holds its parameters and
what happened (JSON). A window (pressure held, partition) starts at
`wall` and lasts `latency_ns`. render() is how `show` prints one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

# mechanism -> what carried the fault out (show's "via" line).
LAYER_MECHANISMS: dict[str, str] = {
    "in-process": "in the campaign's own process",
    "vram-hold": "a process holding device memory",
    "torch-hook": "torch forward hooks on the model",
    "ld-preload": "the LD_PRELOAD shim (gfpreload.so)",
    "tc": "tc on the veth pair (qdisc, BPF drop filter)",
}


def fault_row(
    run_id: str,
    seq: int,
    *,
    action: str,
    function: str,
    mechanism: str,
    outcome: dict[str, Any],
    library: str | None = None,
    wall: float | None = None,
    latency_ns: int | None = None,
    ts_ns: int | None = None,
    pid: int | None = None,
    tid: int | None = None,
    comm: str | None = None,
    spec: int | None = 0,
    call_seq: int | None = None,
    retval: int | None = None,
    ret: int | None = None,
) -> dict[str, Any]:
    """One faults row; pid/tid/comm default to the calling thread (the
    process that carried the fault out), wall to now."""
    assert mechanism in LAYER_MECHANISMS, mechanism
    return {
        "fault_id": f"{run_id}-{seq}",
        "run_id": run_id,
        "seq": seq,
        "spec": spec,
        "func": None,
        "function": function,
        "library": library,
        "build_id": None,
        "action": action,
        "mechanism": mechanism,
        "retval": retval,
        "call_seq": call_seq if call_seq is not None else seq,
        "pid": pid if pid is not None else os.getpid(),
        "tid": tid if tid is not None else threading.get_native_id(),
        "comm": comm if comm is not None else threading.current_thread().name[:15],
        "ts_ns": ts_ns if ts_ns is not None else time.monotonic_ns(),
        "wall": wall if wall is not None else time.time(),
        "ret": ret,
        "latency_ns": latency_ns,
        "outcome": json.dumps(outcome, sort_keys=True, default=str),
    }


def add_spec(db: Any, run_id: str, idx: int, text: str, spec: dict[str, Any]) -> None:
    """The run's spec row: what was asked for, as a line and as JSON."""
    with db.conn:
        db.conn.execute(
            "INSERT OR REPLACE INTO specs (run_id, spec, text, json) VALUES (?, ?, ?, ?)",
            (run_id, idx, text, json.dumps(spec, sort_keys=True, default=str)),
        )


def insert_faults(db: Any, rows: Iterable[dict[str, Any]]) -> None:
    """Insert fault rows in one transaction (a fault_id written twice, e.g.
    a window updated at its end, keeps the last)."""
    rows = list(rows)
    if not rows:
        return
    cols = list(rows[0])
    sql = (
        f"INSERT OR REPLACE INTO faults ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})"
    )
    with db.conn:
        db.conn.executemany(sql, [[r[c] for c in cols] for r in rows])


def tok_case(db: Any, fault_id: str) -> dict[str, Any] | None:
    """The tokenizer case a fault ID names (tok_cases), if any."""
    cur = db.conn.execute("SELECT * FROM tok_cases WHERE fault_id = ?", (fault_id,))
    row = cur.fetchone()
    if row is None:
        return None
    case = dict(zip([c[0] for c in cur.description], row, strict=True))
    if case.get("details"):
        try:
            case["details"] = json.loads(case["details"])
        except ValueError:
            pass
    return case


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def _value(k: str, v: Any) -> str:
    if (
        isinstance(v, int)
        and not isinstance(v, bool)
        and v >= 1 << 20
        and (k.startswith("bytes") or k.startswith("nvml_"))
    ):
        return f"{v} ({v / (1 << 20):.1f} MiB)"
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, default=str)
    return str(v)


def render(doc: dict[str, Any]) -> str:
    """`show` for a fault of one of these layers: what was done, via which
    layer, its parameters and outcome as `key value` lines, the window."""
    f = doc["fault"]
    o = f.get("outcome") if isinstance(f.get("outcome"), dict) else {}
    where = f" in {f['library']}" if f.get("library") else ""
    out = [
        f"fault {f['fault_id']}  ({doc.get('spec') or f['action']})",
        f"  call      {f['function']} #{f['call_seq']}{where}",
        f"  thread    pid {f['pid']} tid {f['tid']} ({f['comm']})",
        f"  action    {f['action']} via {f['mechanism']}"
        f" ({LAYER_MECHANISMS.get(f['mechanism'], '')})",
    ]
    if f.get("wall"):
        line = f"  when      {_when(f['wall'])}"
        if f.get("latency_ns") is not None:
            end = f["wall"] + f["latency_ns"] / 1e9
            line += f" -> {_when(end)} ({f['latency_ns'] / 1e9:.3f} s)"
        out.append(line)
    if o:
        out.append("  outcome")
        width = max(len(k) for k in o)
        out += [f"    {k:{width}}  {_value(k, v)}" for k, v in sorted(o.items())]
    case = doc.get("case")
    if case:
        out.append(
            f"  input     {case['campaign']}/{case['kind']}: {case['input_len']} chars,"
            f" {case['input_bytes']} bytes, sha256 {case['input_sha256'][:16]}..."
        )
        if case.get("details"):
            text = _value("details", case["details"])
            more = f" ... [{len(text) - 300} more characters cut]" if len(text) > 300 else ""
            out.append(f"  details   {text[:300]}{more}")
        if case.get("latency_ns") is not None:
            out.append(f"  took      {case['latency_ns'] / 1000:.1f} us")
        if case.get("text") is not None:
            out.append(f"  text      {case['text'][:200]!r}")
    return "\n".join(out)
