"""Queries over the evidence store: "what did fault X cause?".

The JSON shapes returned here are the stable `--json` output of
`gpufault faults` and `gpufault show` (documented in docs/cli.md).
"""

from __future__ import annotations

import json
from typing import Any

from pyctl.bpf.abi import u64
from pyctl.evidence import layers, words


def _fault_filter(
    run_id: str | None, function: str | None, since: float | None
) -> tuple[str, list[Any]]:
    conds: list[str] = []
    params: list[Any] = []
    for cond, value in (("f.run_id = ?", run_id), ("f.function GLOB ?", function),
                        ("f.wall >= ?", since)):  # fmt: skip
        if value is not None and value != "":
            conds.append(cond)
            params.append(value)
    return ("WHERE " + " AND ".join(conds)) if conds else "", params


def count_faults(
    db: Any,
    *,
    run_id: str | None = None,
    function: str | None = None,
    since: float | None = None,
) -> int:
    """How many faults faults() would list without its limit."""
    where, params = _fault_filter(run_id, function, since)
    return int(db.conn.execute(f"SELECT count(*) FROM faults f {where}", params).fetchone()[0])


def faults(
    db: Any,
    *,
    run_id: str | None = None,
    limit: int = 50,
    function: str | None = None,
    since: float | None = None,
) -> list[dict[str, Any]]:
    """Fired faults, newest first: of one run, of functions matching a glob
    (SQLite GLOB: case-sensitive, as symbol names are), fired at or after
    Unix time `since`."""
    where, params = _fault_filter(run_id, function, since)
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
    # lazy: pyctl.symbols.symbolize (+6 modules, ~200 ms) only when this runs
    from pyctl.symbols.symbolize import name_in

    return name_in(r["module"], r["offset"]) or sym


def latest_fault(db: Any) -> str | None:
    """The newest fault's ID (`show latest`)."""
    row = db.conn.execute(
        "SELECT fault_id FROM faults ORDER BY wall DESC, seq DESC LIMIT 1"
    ).fetchone()
    return None if row is None else str(row[0])


class AmbiguousId(ValueError):
    """A short id that several hosts' runs share (a merged store)."""


def expand_run_id(db: Any, run_id: str) -> str:
    """A run id as stored: the id itself, or for the 8 digits of a run's
    random half (what a node prints short, what the kernel module carries)
    the one 16-digit run that ends with them. AmbiguousId where several
    hosts' runs of a merged store do; the id unchanged where none does."""
    if len(run_id) != 8:
        return run_id
    rows = db.conn.execute(
        "SELECT run_id, host FROM runs WHERE run_id = ? OR "
        "(length(run_id) = 16 AND substr(run_id, 9) = ?) ORDER BY run_id",
        (run_id, run_id),
    ).fetchall()
    if len(rows) == 1:
        return str(rows[0][0])
    if len(rows) > 1:
        raise AmbiguousId(
            f"run {run_id} is in {len(rows)} hosts' runs here ("
            + ", ".join(f"{r[0]} on {r[1]}" for r in rows)
            + "): give the full id"
        )
    return run_id


def expand_fault_id(db: Any, fault_id: str) -> str:
    """expand_run_id for the run part of a fault id."""
    run, dash, seq = fault_id.rpartition("-")
    if not dash:
        return fault_id
    return f"{expand_run_id(db, run)}-{seq}"


def run_fault_ids(db: Any, run_id: str, limit: int | None = None) -> list[str] | None:
    """The faults of a run in fire order (`show RUN`), the first `limit` of
    them (None: all); None: no such run."""
    if db.conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone() is None:
        return None
    rows = db.conn.execute(
        "SELECT fault_id FROM faults WHERE run_id = ? ORDER BY seq LIMIT ?",
        (run_id, -1 if limit is None else limit),
    )
    return [str(r[0]) for r in rows]


def fault_chain(db: Any, fault_id: str) -> dict[str, Any] | None:
    rows = _rows(db, "SELECT * FROM faults WHERE fault_id = ?", (fault_id,))
    if not rows:
        return None
    f = rows[0]
    if f.get("function"):  # rows written before names were stored demangled
        # lazy: pyctl.symbols.demangle (ctypes) only for rows of older runs
        from pyctl.symbols.demangle import demangle

        f["function"] = demangle(f["function"])
    if f.get("outcome"):
        f["outcome"] = json.loads(f["outcome"])
    # The site's other names (funcs.aliases; none before schema 4).
    f["aliases"] = next(
        (
            json.loads(r["aliases"])
            for r in _rows(
                db,
                "SELECT aliases FROM funcs WHERE run_id=? AND func=? AND aliases IS NOT NULL",
                (f["run_id"], f.get("func")),
            )
        ),
        [],
    )
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
        {
            "depth": r["depth"],
            "address": u64(r["address"]),
            "symbol": _late_symbol(r),
            # How it was found (ip, cfi, fp, caller; None before schema 3)
            # and where it is: kept at the fire, the target may be gone.
            "method": r.get("method"),
            "module": r.get("module"),
            "build_id": r.get("build_id"),
            "offset": r.get("offset"),
        }
        for r in _rows(db, "SELECT * FROM stacks WHERE fault_id=? ORDER BY depth", (fault_id,))
    ]
    stack_stop = next(
        (r["stop"] for r in _rows(db, "SELECT stop FROM stacks WHERE fault_id=? AND stop IS NOT "
                                  "NULL ORDER BY depth DESC LIMIT 1", (fault_id,))), None
    )  # fmt: skip
    # The Python stack at the fire (schema 5; pyctl/symbols/pystack.py).
    pyframes = _rows(
        db,
        "SELECT depth, function, file, line, entry FROM pyframes WHERE fault_id=? ORDER BY depth",
        (fault_id,),
    )
    links = _rows(
        db,
        "SELECT kind, rule, ts_ns, pid, tid, detail FROM links WHERE fault_id=? ORDER BY ts_ns",
        (fault_id,),
    )
    names = {
        r["func"]: r
        for r in _rows(db, "SELECT func, symbol, library FROM funcs WHERE run_id=?", (f["run_id"],))
    }
    for link in links:
        link["detail"] = json.loads(link["detail"]) if link["detail"] else None
        # The next error return names its function (detail.func indexes funcs).
        d = link["detail"]
        if link["kind"] == "error-return" and isinstance(d, dict) and d.get("func") in names:
            link["function"] = names[d["func"]]["symbol"]
            link["library"] = names[d["func"]]["library"]
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

    target = _rows(db, "SELECT * FROM targets WHERE run_id=?", (f["run_id"],))

    try:
        spec_json = json.loads(spec[0]["json"]) if spec and spec[0]["json"] else None
    except ValueError:
        spec_json = None
    return {
        "fault": f,
        "spec": spec[0]["text"] if spec else None,
        "spec_json": spec_json,
        # A tokenizer finding's case (tok_cases, same fault ID), else None.
        "case": layers.tok_case(db, fault_id),
        "registers": regs,
        "args": args,
        "stack": stack,
        "stack_stop": stack_stop,
        "pyframes": pyframes,
        "links": links,
        "anchors": anchors,
        "xids": xids,
        "experiment": exp[0] if exp else None,
        "target": target[0] if target else None,
    }


def target_words(t: dict[str, Any] | None) -> str:
    """Who the target was beyond its host pid (container, pod, the
    container's pid, rank, selector); "" for a process of the host armed
    by --pid, where the thread line says it all."""
    if not t:
        return ""
    bits = []
    if t.get("container_id"):
        name = t.get("container_name") or ""
        cid = str(t["container_id"])[:12]
        who = (
            f"{name} ({t.get('runtime') or '?'}, id {cid})"
            if name and name != t["container_id"]
            else f"{cid} ({t.get('runtime') or '?'})"
        )
        bits.append(f"container {who}")
    if t.get("pod_name"):
        bits.append(f"pod {t.get('pod_namespace')}/{t['pod_name']}")
    if t.get("ns_depth"):
        tid = f" tid {t['ns_tid']}" if t.get("ns_tid") else ""
        bits.append(f"its pid {t['ns_pid']}{tid} in its PID namespace")
    if t.get("rank") is not None:
        bits.append(f"rank {t['rank']}")
    if t.get("selector"):
        bits.append(f"chosen by {t['selector']}")
    if t.get("root"):
        # Its module paths are its own; on the host they are under this.
        bits.append(f"its files under {t['root']} on the host")
    return ", ".join(bits)


def _action_line(f: dict[str, Any]) -> str:
    """'fail via copilot, injected 2'; never 'injected' for a fire whose
    injection did not happen (outcome.injected false)."""
    raw = f.get("outcome")
    o: dict[str, Any] = raw if isinstance(raw, dict) else {}
    line = f"  action    {f['action']} via {f['mechanism']}"
    if o.get("injected") is False:
        why = (o.get("copilot") or {}).get("error") or o.get("corrupt_error") or o.get("error")
        return line + ", NOT injected" + (f": {why}" if why else "")
    if f["retval"] is None:
        return line
    return line + f", injected {words.code_name(f['function'], f['library'], f['retval'])}"


_EVAL = "_PyEval_EvalFrameDefault"


def _pyframe(p: dict[str, Any]) -> str:
    at = p["line"] if p["line"] is not None else "?"
    return f"py#{p['depth']:<2} {p['function']} ({p['file']}:{at})"


def _eval_groups(pyframes: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Python frames cut into the runs of one eval-loop call each, innermost
    first: a run ends at its entry frame (pyframes.entry)."""
    groups: list[list[dict[str, Any]]] = [[]]
    for p in pyframes:
        groups[-1].append(p)
        if p.get("entry"):
            groups.append([])
    return [g for g in groups if g]


def render_chain(doc: dict[str, Any]) -> str:
    f = doc["fault"]

    if f.get("mechanism") in layers.LAYER_MECHANISMS:
        # Tokenizer, hook and netchaos faults: no library call, registers
        # or stack; their parameters and outcome, in words.
        return layers.render(doc)
    out = [
        f"fault {f['fault_id']}  ({doc['spec']})",
        f"  call      {f['function']}{words.alias_note(f.get('aliases'))} #{f['call_seq']} "
        f"in {f['library']}",
        f"  build-id  {f['build_id'] or '-'}",
        f"  thread    pid {f['pid']} tid {f['tid']} ({f['comm']})",
        *([f"  target    {tw}"] if (tw := target_words(doc.get("target"))) else []),
        f"  time      {words.wall_time(f.get('wall'), '%Y-%m-%d %H:%M:%S.%f')[:23]}",
        *(
            [
                f"  experiment {x['id']} {x['name']}@v{x['version']} step {x['idx'] + 1} "
                f"({x['step']}): {x['verdict']}"
            ]
            if (x := doc.get("experiment"))
            else []
        ),
        _action_line(f),
        words.returned_line(f),
    ]
    for i, phrase in enumerate(words.outcome_words(f, doc.get("spec_json"))):
        out.append(f"  {'outcome' if i == 0 else '':9} {phrase}")
    if doc["args"]:
        out.append("  args")
        for a in doc["args"]:
            shown = a["decoded"] if a["decoded"] is not None else words.hexaddr(a["raw"])
            out.append(f"    {a['name']:12} {shown}")
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
    pyframes = doc.get("pyframes") or []
    groups = _eval_groups(pyframes)
    evals = [s for s in doc["stack"] if _EVAL in (s["symbol"] or "")]
    # Joined as `py-spy dump --native` joins them: each eval-loop frame is
    # followed by the Python frames it was running, where the counts agree
    # (a stack that ended early, or frames read after the thread moved on,
    # are listed apart instead).
    joined = bool(groups) and len(groups) == len(evals)
    if doc["stack"]:
        out.append("  stack" + (" (Python frames under the eval loop's)" if joined else ""))
        g = iter(groups)
        for s in doc["stack"]:
            how = f"  [{s['method']}]" if s.get("method") else ""
            out.append(f"    #{s['depth']:<2} {s['address']:#018x} {s['symbol']}{how}")
            if joined and _EVAL in (s["symbol"] or ""):
                out.extend(f"        {_pyframe(p)}" for p in next(g))
        if doc.get("stack_stop"):
            out.append(f"    (ends: {doc['stack_stop']})")
    if (py_note := words.python_read_words(f)) is not None:
        out.append(f"  python stack ({py_note})")
        if not joined:
            out.extend(f"    {_pyframe(p)}" for p in pyframes)
    out.append(
        "  what followed"
        if doc["links"] or doc["anchors"] or doc["xids"]
        else "  nothing linked to it (yet)"
    )
    for link in doc["links"]:
        out.append(f"    {link['kind']:8} {words.link_words(link, f)}  [rule: {link['rule']}]")
    for x in doc["xids"]:
        out.append(
            f"    xid      {x.get('error_code')} on {x.get('dev')}: {x.get('msg')}  "
            f"[rule: {x.get('rule')}]"
        )
    for a in doc["anchors"]:
        out.append(f"    anchor   {a.get('kind')} {a.get('bdf')}  [record {a.get('rec_seq')}]")
    return "\n".join(out)
