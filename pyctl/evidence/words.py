"""Evidence in words: the phrases `show`, `faults` and `timeline` print.

The store keeps numbers and JSON (the stable --json output); a person reads
"copilot: stopped 5.1 ms, injected CUDA_ERROR_OUT_OF_MEMORY (2), resumed at
the return address". Every function here takes rows as the store returns
them and never fails on a field that is missing or odd: evidence from an
older run must still render.
"""

from __future__ import annotations

import datetime as _dt
import errno as _errno
import signal as _signal
from typing import Any

from pyctl.bpf import abi

U64 = (1 << 64) - 1


def hexaddr(v: Any) -> str:
    """An address or register as unsigned hex (the store keeps signed 64-bit)."""
    if v is None:
        return "-"
    try:
        return f"{int(v) & U64:#x}"
    except (TypeError, ValueError):
        return str(v)


def signal_name(signo: Any) -> str:
    """'SIGSEGV (11)'; real-time signals as 'SIGRTMIN+2 (36)'; glibc's own 32
    and 33 have no name in Python: 'signal 32'."""
    try:
        n = int(signo)
    except (TypeError, ValueError):
        return str(signo)
    try:
        return f"{_signal.Signals(n).name} ({n})"
    except ValueError:
        lo, hi = int(_signal.SIGRTMIN), int(_signal.SIGRTMAX)
        if lo < n <= hi:
            return f"SIGRTMIN+{n - lo} ({n})"
        return f"signal {n}"


def code_name(function: str | None, library: str | None, value: Any) -> str:
    """A return value as the catalog names it: 'CUDA_ERROR_OUT_OF_MEMORY (2)';
    a value of a function no catalog knows (or a code its table lacks) stays
    a number. Same rule as the trace summaries (pyctl/catalog/rules.py)."""
    if value is None:
        return "-"
    try:
        v = int(value)
    except (TypeError, ValueError):
        return str(value)
    try:
        # lazy: the catalog's code tables (~15 ms) only when a code is named
        from pyctl.catalog.rules import error_rule

        rule = error_rule(function or "", library or "")
        name = rule.code_name(v) if rule.lib is not None else ""
        # code_name gives the number back for a code its table lacks.
        if name and not name.lstrip("-").isdigit():
            return f"{name} ({v})"
    except Exception:  # noqa: BLE001 - naming is decoration, the number is the evidence
        pass
    return str(v)


def duration_ns(ns: Any) -> str:
    """5.1 ms, 320 us, 1.25 s."""
    try:
        n = float(ns)
    except (TypeError, ValueError):
        return "?"
    if n >= 1e9:
        return f"{n / 1e9:.2f} s"
    if n >= 1e6:
        return f"{n / 1e6:.1f} ms"
    if n >= 1e3:
        return f"{n / 1e3:.1f} us"
    return f"{n:.0f} ns"


def wall_time(wall: Any, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    """Unix time as local time, for the text columns (--json keeps the number)."""
    if wall is None:
        return "-"
    try:
        return _dt.datetime.fromtimestamp(float(wall)).strftime(fmt)
    except (TypeError, ValueError, OverflowError, OSError):
        return str(wall)


def _copilot_words(f: dict[str, Any], cop: dict[str, Any]) -> str:
    action = cop.get("action")
    stop, resume = cop.get("stop_ns") or 0, cop.get("resume_ns") or 0
    err = cop.get("error")
    if action == abi.ACT_STALL:
        if not stop:
            return f"copilot: never held the thread{': ' + err if err else ''}"
        held = f"held the thread {duration_ns(resume - stop)}" if resume else "held the thread"
        end = ", released" if resume else ", never released (the thread or the copilot ended)"
        return f"copilot: {held}{end}{': ' + err if err else ''}"
    held = f"stopped {duration_ns(resume - stop)}" if stop and resume else "stopped"
    if err:
        return f"copilot: {held}, NOT injected: {err}"
    bits = [held]
    if f.get("retval") is not None:
        bits.append(f"injected {code_name(f.get('function'), f.get('library'), f.get('retval'))}")
    if cop.get("errno"):
        n = cop["errno"]
        name = _errno.errorcode.get(n) if isinstance(n, int) else None
        bits.append(f"errno {name} ({n})" if name else f"errno {n}")
    ip_after, ret_addr, ip_before = cop.get("ip_after"), cop.get("ret_addr"), cop.get("ip_before")
    if ip_after and ret_addr and ip_after == ret_addr:
        bits.append("resumed at the return address")
    elif ip_after and ip_after == ip_before:
        bits.append(f"resumed where it stopped ({hexaddr(ip_after)})")
    elif ip_after:
        bits.append(f"resumed at {hexaddr(ip_after)}")
    if not resume:
        bits.append("never resumed (the thread exited at the stop)")
    return "copilot: " + ", ".join(bits)


def alias_note(aliases: Any) -> str:
    """' (alias cuMemAlloc)' after a function that has other names at its
    address (funcs.aliases), else ''."""
    if not isinstance(aliases, list) or not aliases:
        return ""
    return f" (alias{'es' if len(aliases) > 1 else ''} {', '.join(map(str, aliases))})"


def returned_line(f: dict[str, Any]) -> str:
    """`show`'s "returned" line: the value by name and the call's latency;
    a stall's held time (latency_ns is how long the thread was held); "did
    not return" with the reason where the store says so (outcome.returned
    false: the process died first), never a value nobody saw."""
    raw = f.get("outcome")
    o: dict[str, Any] = raw if isinstance(raw, dict) else {}
    lat = f.get("latency_ns")
    if o.get("returned") is False:
        why = o.get("no_return")
        return "  returned  did not return" + (f" ({why})" if why else "")
    if f.get("ret") is not None:
        text = code_name(f.get("function"), f.get("library"), f.get("ret"))
        return f"  returned  {text}" + (f" after {duration_ns(lat)}" if lat else "")
    if f.get("action") == "stall" and lat:
        return f"  returned  (no return seen) after a hold of {duration_ns(lat)}"
    return "  returned  (no return seen)"


def _corrupt_words(o: dict[str, Any], spec: dict[str, Any] | None) -> str:
    c: list[Any] = list((spec or {}).get("corrupt") or ())
    n = c[4] if len(c) >= 5 and c[4] in (1, 2, 4, 8) else 8
    how = ""
    if len(c) >= 4:
        op = {v: k for k, v in abi.CORRUPT_OPS.items()}.get(c[2], "")
        how = {"zero": " (zeroed)", "xor": f" (xor {hexaddr(c[3])})", "set": f" (set to "
               f"{hexaddr(c[3])})"}.get(op, "")  # fmt: skip
    at = hexaddr(o.get("corrupt_addr"))
    if o.get("corrupt_error"):
        return f"corrupt of {n} bytes at {at} failed: {o['corrupt_error']}"
    return f"corrupted {n} bytes at {at}{how}"


def outcome_words(f: dict[str, Any], spec: dict[str, Any] | None = None) -> list[str]:
    """What finished a fault outside BPF (faults.outcome), one phrase per
    part: the copilot's stop, the corrupt write, the signal sent; last, why
    it was NOT injected when nothing else says so. `spec` is specs.json."""
    raw = f.get("outcome")
    o: dict[str, Any] = raw if isinstance(raw, dict) else {}
    out: list[str] = []
    cop = o.get("copilot")
    if isinstance(cop, dict):
        out.append(_copilot_words(f, cop))
    if "corrupt_addr" in o or "corrupt_error" in o:
        out.append(_corrupt_words(o, spec))
    if o.get("signal"):
        out.append(f"sent {signal_name(o['signal'])}")
    h = o.get("helper")
    if isinstance(h, dict):
        # The signal path's in-target helper: its counts are the run's.
        counts = ", ".join(f"{h.get(k, 0)} {k}" for k in ("handled", "inert", "stray"))
        out.append(f"in-target helper on {h.get('signal', '?')} (run: {counts})")
    if o.get("injected") is False and not any("NOT injected" in s or "failed" in s for s in out):
        out.append("NOT injected" + (f": {o['error']}" if o.get("error") else ""))
    return out


def python_read_words(f: dict[str, Any]) -> str | None:
    """How a fault's Python stack was read (outcome.python, written at the
    fire's ingest): the CPython version and whether the thread was still at
    the fault then (held by the copilot, read before it was let go), or
    how long after the fire it was read once the thread had moved on (a
    call that BPF failed returns at once). None: no CPython in the process."""
    raw = f.get("outcome")
    o: dict[str, Any] = raw if isinstance(raw, dict) else {}
    py = o.get("python")
    if not isinstance(py, dict):
        return None
    if py.get("error") and not py.get("version"):
        return str(py["error"])
    head = f"CPython {py.get('version')}"
    read_ns, fire_ns = int(py.get("read_ns") or 0), int(py.get("fire_ns") or 0)
    cop = o.get("copilot") if isinstance(o.get("copilot"), dict) else None
    after = duration_ns(read_ns - fire_ns) if read_ns and fire_ns else "?"
    if (
        cop is not None
        and cop.get("stop_ns")
        and (not cop.get("resume_ns") or read_ns <= int(cop["resume_ns"]))
    ):
        when = f"read while the copilot held the thread, {after} after the fire"
    elif cop is None and f.get("mechanism") == "copilot":
        when = f"read {after} after the fire; the copilot's hold is not known yet"
    else:
        when = f"read {after} after the fire, once the thread had moved on: it may be past the call"
    err = f"; stopped: {py['error']}" if py.get("error") else ""
    return f"{head}, {when}{err}"


def link_words(
    link: dict[str, Any], fault: dict[str, Any] | None = None, *, brief: bool = False
) -> str:
    """One link (what followed) in words: a signal by name and cause, an
    exit status or the signal that killed it, the next error return by code
    name. `fault` gives the time base (+N after the fault); `brief` leaves
    out the si_code and the thread (a timeline line has 80 columns)."""
    raw = link.get("detail")
    d: dict[str, Any] = raw if isinstance(raw, dict) else {}
    kind = link.get("kind")
    if kind == "signal":
        text = f"{signal_name(d.get('signal'))}"
        if d.get("code") is not None and not brief:
            text += f", si_code {d.get('code')}"
        why = d.get("cause") or d.get("why")
        text += f": {why}" if why else ""
    elif kind == "exit":
        if d.get("term_signal"):
            text = f"killed by {signal_name(d['term_signal'])}" + (
                " (core dumped)" if d.get("core") else ""
            )
        else:
            text = f"exited with status {d.get('exit_status')}"
    elif kind == "error-return":
        fn = link.get("function") or f"func {d.get('func')}"
        text = f"{fn} returned {code_name(fn, link.get('library'), d.get('ret'))}"
    else:
        text = ", ".join(f"{k} {v}" for k, v in d.items()) if d else ""
    who = (
        f" in pid {link.get('pid')} tid {link.get('tid')}" if link.get("pid") and not brief else ""
    )
    after = ""
    if fault and fault.get("ts_ns") and link.get("ts_ns"):
        after = f", {duration_ns(link['ts_ns'] - fault['ts_ns'])} after the fault"
    return f"{text}{who}{after}"


# runs.stats["events_lost_why"] keys (pyctl/engine: Engine.loss_causes) in words.
_LOSS_CAUSES = (
    ("ring_full", "ring full"),
    # the ring's lock gave up, a record still being written held it back,
    # or the consumer freed room in between
    ("room_when_read", "room when looked at"),
)


def loss_words(why: dict[str, Any] | None) -> str:
    """Like "ring full 21, room when looked at 2"; "" when nothing was lost."""
    if not why:
        return ""
    return ", ".join(f"{label} {why[k]}" for k, label in _LOSS_CAUSES if why.get(k))
