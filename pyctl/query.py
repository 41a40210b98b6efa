"""Queries over the evidence store: "what did fault X cause?".

The JSON shapes returned here are the stable `--json` output of
`gpufault faults` and `gpufault show` (documented in docs/cli.md).
"""

from __future__ import annotations

import json
from typing import Any

from pyctl.bpf.abi import u64


def faults(db: Any, *, run_id: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    where = "WHERE f.run_id = ?" if run_id else ""
    params: list[Any] = [run_id] if run_id else []
    sql = (
        "SELECT f.fault_id, f.run_id, f.function, f.library, f.action, f.mechanism, f.retval, "
        "f.ret, f.latency_ns, f.call_seq, f.pid, f.tid, f.comm, f.wall, "
        "(SELECT count(*) FROM links l WHERE l.fault_id = f.fault_id) AS links "
        f"FROM faults f {where} ORDER BY f.wall DESC, f.seq DESC LIMIT ?"
    )
    cur = db.conn.execute(sql, [*params, limit])
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def _rows(db: Any, sql: str, params: tuple[Any, ...]) -> list[dict[str, Any]]:
    cur = db.conn.execute(sql, params)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


def _late_symbol(r: dict[str, Any]) -> str:
    """Frames left as 'lib+0xoff' at ingest (big libraries are not parsed
    while events stream in) are named now, if the library is still there."""
    sym = r["symbol"]
    if "!" in (sym or "") or not r.get("module") or r.get("offset") is None:
        return sym
    from pyctl.symbolize import name_in

    return name_in(r["module"], r["offset"]) or sym


def fault_chain(db: Any, fault_id: str) -> dict[str, Any] | None:
    rows = _rows(db, "SELECT * FROM faults WHERE fault_id = ?", (fault_id,))
    if not rows:
        return None
    f = rows[0]
    if f.get("outcome"):
        f["outcome"] = json.loads(f["outcome"])
    spec = _rows(
        db, "SELECT text, json FROM specs WHERE run_id=? AND spec=?", (f["run_id"], f["spec"])
    )
    regs = {
        r["reg"]: u64(r["value"])
        for r in _rows(db, "SELECT reg, value FROM registers WHERE fault_id=?", (fault_id,))
    }
    args = [
        {"idx": r["idx"], "name": r["name"], "raw": u64(r["raw"]), "decoded": r["decoded"]}
        for r in _rows(db, "SELECT * FROM args WHERE fault_id=? ORDER BY idx", (fault_id,))
    ]
    stack = [
        {"depth": r["depth"], "address": u64(r["address"]), "symbol": _late_symbol(r)}
        for r in _rows(db, "SELECT * FROM stacks WHERE fault_id=? ORDER BY depth", (fault_id,))
    ]
    links = _rows(
        db,
        "SELECT kind, rule, ts_ns, pid, tid, detail FROM links WHERE fault_id=? ORDER BY ts_ns",
        (fault_id,),
    )
    for link in links:
        link["detail"] = json.loads(link["detail"]) if link["detail"] else None
    # Every table is there (store.open_db: created, or overlaid for an
    # older file opened read-only).
    anchors = _rows(db, "SELECT * FROM anchors WHERE fault_id=?", (fault_id,))
    for a in anchors:
        for k, v in list(a.items()):
            if isinstance(v, bytes):
                a[k] = v.hex()
    xids = _rows(db, "SELECT * FROM xids WHERE fault_id=?", (fault_id,))
    # The experiment whose step armed this fault's run (gpufault experiment).
    exp = _rows(
        db,
        "SELECT e.id, e.name, e.version, e.verdict, s.idx, s.name AS step FROM experiment_steps s "
        "JOIN experiments e ON e.id = s.experiment_id WHERE s.run_id=?",
        (f["run_id"],),
    )
    return {
        "fault": f,
        "spec": spec[0]["text"] if spec else None,
        "registers": regs,
        "args": args,
        "stack": stack,
        "links": links,
        "anchors": anchors,
        "xids": xids,
        "experiment": exp[0] if exp else None,
    }


def _action_line(f: dict[str, Any]) -> str:
    """'fail via copilot, injected 2'; never 'injected' for a fire whose
    injection did not happen (outcome.injected false)."""
    raw = f.get("outcome")
    o: dict[str, Any] = raw if isinstance(raw, dict) else {}
    line = f"  action    {f['action']} via {f['mechanism']}"
    if o.get("injected") is False:
        why = (o.get("copilot") or {}).get("error") or o.get("corrupt_error") or o.get("error")
        return line + ", NOT injected" + (f": {why}" if why else "")
    return line + (f", injected {f['retval']}" if f["retval"] is not None else "")


def render_chain(doc: dict[str, Any]) -> str:
    f = doc["fault"]
    out = [
        f"fault {f['fault_id']}  ({doc['spec']})",
        f"  call      {f['function']} #{f['call_seq']} in {f['library']}",
        f"  build-id  {f['build_id'] or '-'}",
        f"  thread    pid {f['pid']} tid {f['tid']} ({f['comm']})",
        *(
            [f"  experiment {x['id']} {x['name']}@v{x['version']} step {x['idx'] + 1} "
             f"({x['step']}): {x['verdict']}"]
            if (x := doc.get("experiment"))
            else []
        ),
        _action_line(f),
        f"  returned  {f['ret'] if f['ret'] is not None else '(no return seen)'}"
        + (f" after {f['latency_ns'] / 1000:.1f} us" if f["latency_ns"] else ""),
    ]
    if f.get("outcome"):
        out.append(f"  outcome   {json.dumps(f['outcome'])}")
    if doc["args"]:
        out.append("  args")
        for a in doc["args"]:
            out.append(f"    {a['name']:12} {a['decoded']}")
    if doc["registers"]:
        regs = doc["registers"]
        names = [
            "ip",
            "sp",
            "bp",
            "ax",
            "di",
            "si",
            "dx",
            "cx",
            "r8",
            "r9",
            "bx",
            "r12",
            "r13",
            "r14",
            "r15",
            "flags",
        ]
        out.append("  registers at entry")
        line = []
        for n in names:
            if n in regs:
                line.append(f"{n}={regs[n]:#x}")
            if len(line) == 4:
                out.append("    " + "  ".join(line))
                line = []
        if line:
            out.append("    " + "  ".join(line))
    if doc["stack"]:
        out.append("  stack")
        for s in doc["stack"]:
            out.append(f"    #{s['depth']:<2} {s['address']:#018x} {s['symbol']}")
    out.append(
        "  what followed"
        if doc["links"] or doc["anchors"] or doc["xids"]
        else "  nothing linked to it (yet)"
    )
    for link in doc["links"]:
        out.append(f"    {link['kind']:8} {json.dumps(link['detail'])}  [rule: {link['rule']}]")
    for x in doc["xids"]:
        out.append(
            f"    xid      {x.get('error_code')} on {x.get('dev')}: {x.get('msg')}  "
            f"[rule: {x.get('rule')}]"
        )
    for a in doc["anchors"]:
        out.append(f"    anchor   {a.get('kind')} {a.get('bdf')}  [record {a.get('seq')}]")
    return "\n".join(out)
