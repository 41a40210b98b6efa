"""Assertions on a session's evidence, for tests (the pytest plugin's, or
anyone's): what fired, and what the evidence rules linked to a fault.

    h = gpufault.arm(Fault.fail(lib, "gf_victim", ret=-5, nth=3), pid, db=db)
    ...
    (f,) = gpufault.assert_fired(h, n=1, function="gf_victim", code=-5)
    gpufault.assert_followed(f, "exit", term_signal="SIGSEGV")

Each raises AssertionError whose text says what was expected, what was
found, and what the run saw (its calls and fires, or what followed the
fault), so a failing test reads as a diagnosis, not as `assert 0 == 1`.
Both read the store (read-only): what they check is what `gpufault show`
shows.
"""

from __future__ import annotations

import fnmatch
import signal as _signal
import time
from collections.abc import Sequence
from typing import Any, Protocol

from pyctl.api.evidence import Evidence, FaultRecord

# How often a timeout re-reads the store: the rows come from another thread
# or process (the controller, the evidence rules), and SQLite has nothing to
# wait on.
_POLL_S = 0.05

# What a kind of link reads from in fault_chain(): xids and anchors have
# their own tables; the rest are links rows.
_LINK_KINDS = ("error-return", "signal", "exit", "anchor", "xid")


class _HasFaults(Protocol):
    run_id: str

    @property
    def db(self) -> str: ...

    def faults(self) -> list[FaultRecord]: ...


def _code_matches(f: FaultRecord, code: int | str) -> bool:
    """An int is the injected value; a name is the catalog's ('CUDA_ERROR_OUT_OF_MEMORY'),
    as `gpufault show` names it."""
    if isinstance(code, bool):
        return False
    if isinstance(code, int):
        return f.retval == code
    text = str(code).strip()
    if text.lstrip("-").isdigit():
        return f.retval == int(text)
    # lazy: keeps pyctl.evidence.words (+28 modules, ~100 ms) off `import gpufault`
    from pyctl.evidence.words import code_name

    return code_name(f.function, f.library, f.retval).split(" (")[0] == text


def _fault_line(f: FaultRecord) -> str:
    # lazy: keeps pyctl.evidence.words (+28 modules, ~100 ms) off `import gpufault`
    from pyctl.evidence.words import code_name

    injected = f" {code_name(f.function, f.library, f.retval)}" if f.retval is not None else ""
    return (
        f"{f.fault_id}: {f.function} {f.action}{injected} via {f.mechanism}, "
        f"call {f.call_seq}, pid {f.pid} tid {f.tid}"
    )


def _wanted(n: int | None, function: str | None, code: int | str | None,
            action: str | None) -> str:  # fmt: skip
    what = "at least 1 fault" if n is None else f"{n} fault{'' if n == 1 else 's'}"
    if action:
        what += f" ({action})"
    if function:
        what += f" of {function}"
    if code is not None:
        what += f" with code {code}"
    return what


def assert_fired(
    session: _HasFaults | Sequence[FaultRecord],
    n: int | None = None,
    *,
    function: str | None = None,
    code: int | str | None = None,
    action: str | None = None,
    timeout: float = 0.0,
) -> list[FaultRecord]:
    """The session's faults that match (function: a name or glob; code: the
    injected value or its catalog name; action: fail, stall, signal,
    corrupt, observe); exactly `n` of them, or at least one when n is None.
    With a timeout, wait up to that long for them first (the session's
    fires, then the store). Returns the matching records."""
    if n is not None and n < 0:
        raise ValueError(f"assert_fired: n={n} is negative")

    def matching(records: list[FaultRecord]) -> list[FaultRecord]:
        return [
            f for f in records
            if (not function or fnmatch.fnmatchcase(f.function, function))
            and (code is None or _code_matches(f, code))
            and (not action or f.action == action)
        ]  # fmt: skip

    def read() -> list[FaultRecord]:
        return list(session) if isinstance(session, Sequence) else session.faults()

    deadline = time.monotonic() + max(timeout, 0.0)
    wait = getattr(session, "wait_fires", None)
    if timeout > 0 and wait is not None:
        wait(n or 1, timeout=timeout)
    records = read()
    found = matching(records)
    # Enough fires but not (yet) the matching ones: the store may still be
    # behind the fires the session counted, until the deadline.
    while (len(found) < (n or 1)) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        records = read()
        found = matching(records)
    if (n is None and found) or (n is not None and len(found) == n):
        return found
    where = ""
    if not isinstance(session, Sequence):
        where = f" in run {session.run_id or '(not armed)'} ({session.db})"
    lines = [f"gpufault: expected {_wanted(n, function, code, action)}{where}, found {len(found)}"]
    if found:
        lines.append("  matching:")
        lines += [f"    {_fault_line(f)}" for f in found]
    others = [f for f in records if f not in found]
    if others:
        lines.append("  fired, not matching:")
        lines += [f"    {_fault_line(f)}" for f in others]
    if not records:
        lines.append("  nothing fired")
    c = getattr(session, "counters", None)
    if c is not None:
        status = getattr(session, "status", "")
        lines.append(
            f"  the probes saw {c.calls} matching call{'' if c.calls == 1 else 's'}"
            + (f", {c.lost} records lost (ring full)" if c.lost else "")
            + (f"; the session is {status}" if status else "")
        )
    raise AssertionError("\n".join(lines))


def _sig(v: Any) -> Any:
    """'SIGSEGV' -> 11, so a detail compares by name or number."""
    if isinstance(v, str) and v.upper().startswith("SIG"):
        try:
            return int(_signal.Signals[v.upper()])
        except KeyError:
            return v
    return v


def _links(doc: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    if kind == "xid":
        return list(doc.get("xids") or [])
    if kind == "anchor":
        return list(doc.get("anchors") or [])
    return [ln for ln in doc.get("links") or [] if ln.get("kind") == kind]


def _detail_matches(link: dict[str, Any], detail: dict[str, Any]) -> bool:
    raw = link.get("detail")
    d: dict[str, Any] = raw if isinstance(raw, dict) else {}
    for k, want in detail.items():
        have = d.get(k, link.get(k))
        if k in ("signal", "term_signal"):
            want = _sig(want)
        if have != want:
            return False
    return True


def _followed_lines(doc: dict[str, Any]) -> list[str]:
    # lazy: keeps pyctl.evidence.words (+28 modules, ~100 ms) off `import gpufault`
    from pyctl.evidence.words import link_words

    f = doc["fault"]
    out = [
        f"    {ln['kind']:12} {link_words(ln, f)}  [rule: {ln.get('rule')}]"
        for ln in doc.get("links") or []
    ]
    out += [f"    xid          {x.get('error_code')} on {x.get('dev')}: {x.get('msg')}"
            for x in doc.get("xids") or []]  # fmt: skip
    out += [f"    anchor       {a.get('kind')} {a.get('bdf')}" for a in doc.get("anchors") or []]
    return out


def assert_followed(
    fault: FaultRecord | str,
    kind: str,
    *,
    db: str | None = None,
    rule: str | None = None,
    timeout: float = 0.0,
    **detail: Any,
) -> list[dict[str, Any]]:
    """What the evidence rules linked to `fault` (a FaultRecord, or a fault
    ID with db=): at least one link of `kind` (exit, signal, error-return,
    anchor, xid), by `rule` if given, whose detail has the given values
    (exit_status=1, term_signal="SIGSEGV", signal="SIGSEGV", ret=2 ...).
    With a timeout, wait up to that long for it (an exit is linked when
    the process exits). Returns the matching links."""
    if kind not in _LINK_KINDS:
        raise ValueError(f"assert_followed: kind {kind!r}: one of {', '.join(_LINK_KINDS)}")
    path: str | None
    if isinstance(fault, FaultRecord):
        fault_id, path = fault.fault_id, db or fault.db_path
    else:
        fault_id, path = str(fault), db
        if not path:
            raise ValueError("assert_followed: give db= with a fault ID (or pass a FaultRecord)")
    deadline = time.monotonic() + max(timeout, 0.0)
    while True:
        with Evidence(path) as ev:
            doc = ev.chain(fault_id)
        found = [
            ln for ln in _links(doc, kind)
            if (rule is None or ln.get("rule") == rule) and _detail_matches(ln, detail)
        ]  # fmt: skip
        if found or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    if found:
        return found
    f = doc["fault"]
    want = kind + (f" by rule {rule}" if rule else "")
    if detail:
        want += " with " + ", ".join(f"{k}={v}" for k, v in detail.items())
    injected = f" {f.get('retval')}" if f.get("retval") is not None else ""
    lines = [
        f"gpufault: fault {fault_id} ({f.get('function')} {f.get('action')}{injected}, "
        f"pid {f.get('pid')} tid {f.get('tid')}) was not followed by {want}"
    ]
    followed = _followed_lines(doc)
    if followed:
        lines.append("  what followed:")
        lines += followed
    else:
        lines.append(
            "  nothing was linked to it (the rules link the faulted thread's next error "
            "return, a signal to or the exit of the faulted process, Xids, kernel anchors)"
        )
    raise AssertionError("\n".join(lines))


__all__ = ["assert_fired", "assert_followed"]
