"""Network chaos between two namespaces from Python (pyctl/netchaos.py does
the kernel side): a held link, and impairment windows on it (partition,
delay, loss, rate) that are undone at their end and stored as one run with
one fault each, as `gpufault netchaos` does.

    stop = Stop()                      # stop.set("SIGTERM") ends a window early
    link(db, duration=60, stop=stop, on_ready=print)
    loss(db, 5.0, direction="a2b", for_s=30)

Every window is undone on every exit (its end, stop, an error), and its
watchdog lifts it if this process dies first. Nothing here installs a
signal handler: the caller sets `stop` from its own.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pyctl.exceptions import BadInput, MissingPrerequisite


class Stop:
    """Ends a held link or a window early, and says why (a signal's name);
    set from a signal handler or another thread."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = "duration"

    def set(self, reason: str) -> None:
        self.reason = reason
        self.event.set()

    def wait(self, timeout: float | None) -> bool:
        return self.event.wait(timeout)


def need_root(what: str) -> None:
    """MissingPrerequisite unless root (network namespaces, tc)."""
    if os.geteuid() != 0:
        raise MissingPrerequisite(
            f"netchaos {what} needs root (network namespaces, tc): run it with sudo"
        )


def cleanup(all_owners: bool = False) -> list[str]:
    """Remove gf* namespaces (and their veths) left by dead processes (with
    all_owners, also those of live ones); the names removed."""
    # lazy: keeps pyctl.netchaos (ast, base64, +35 modules, ~200 ms) off `--help`
    from pyctl import netchaos

    if os.geteuid() != 0:
        raise MissingPrerequisite("netchaos cleanup needs root: run it with sudo")
    return netchaos.cleanup(all_owners=all_owners)


def link(
    db: str | os.PathLike[str],
    *,
    duration: float | None = None,
    stop: Stop | None = None,
    argv: Sequence[str] = (),
    on_ready: Callable[[Any, str], None] | None = None,
) -> str:
    """Create two namespaces joined by a veth pair and hold them for
    `duration` seconds (None: until stop), then tear them down; the run
    (kind netchaos:link) is stored in db. on_ready(link, run_id) once both
    ends are up (link.name, link.a/.b: ns, ifname, addr). Returns the run id."""
    # lazy: keeps pyctl.netchaos (ast, base64, +35 modules, ~200 ms) off `--help`
    from pyctl import netchaos

    # lazy: pyctl.evidence.store (ast, copy, +26 modules, ~100 ms) only when this runs
    from pyctl.evidence import store

    need_root("link")
    stop = stop or Stop()
    lk = netchaos.Link()
    conn = None
    run_id = ""
    try:
        try:
            lk.open()
        except netchaos.NetChaosError as e:
            raise netchaos.NetChaosError(f"netchaos link: {e}") from None
        conn = store.open_db(db)
        run_id = store.new_run(conn, list(argv), "netchaos:link", mechanism="tc")
        if on_ready is not None:
            on_ready(lk, run_id)
        stop.wait(duration)
        status = "done" if stop.reason == "duration" else "interrupted"
    except BaseException:
        status = "failed"
        raise
    finally:
        lk.close()
        if conn is not None and run_id:
            store.end_run(
                conn,
                run_id,
                status,
                None,
                {
                    "link": lk.name,
                    "a": [lk.a.ns, lk.a.addr],
                    "b": [lk.b.ns, lk.b.addr],
                    "ended_by": stop.reason,
                },
            )
            conn.close()
    return run_id


def window(
    what: str,
    params: dict[str, Any],
    apply: Callable[[Any], None],
    db: str | os.PathLike[str],
    *,
    link_name: str | None = None,
    direction: str = "both",
    for_s: float | None = None,
    stop: Stop | None = None,
    argv: Sequence[str] = (),
    on_started: Callable[[Any, str], None] | None = None,
) -> str:
    """One impairment window: attach to the link (link_name, default the
    only one), store the run and its open fault, apply(link), wait for_s
    (None: until stop), undo, and close the fault (its end, the drop
    filter's counters) and the run. on_started(link, run_id) once the
    impairment is in place. Returns the run id. partition/delay/loss/rate
    below are this with their apply."""
    # lazy: keeps pyctl.netchaos (ast, base64, +35 modules, ~200 ms) off `--help`
    from pyctl import netchaos

    # lazy: pyctl.evidence.store (ast, copy, +27 modules, ~100 ms) only when this runs
    from pyctl.evidence import layers, store

    need_root(what)
    if what == "delay" and not netchaos.netem_available():
        raise MissingPrerequisite(
            "netchaos delay: this kernel lacks sch_netem: load it with `modprobe sch_netem`"
            " (CONFIG_NET_SCH_NETEM), or use loss, rate or partition"
        )
    try:
        lk = netchaos.Link.attach(link_name, for_s=for_s)
    except netchaos.NetChaosError as e:
        raise BadInput(f"netchaos {what}: {e}") from None
    stop = stop or Stop()
    conn = None
    run_id, status = "", "failed"
    outcome: dict[str, Any] = {"direction": direction, **params}
    row: dict[str, Any] = {}
    t0 = time.time()
    m0 = time.monotonic_ns()
    try:
        conn = store.open_db(db)
        run_id = store.new_run(conn, list(argv), f"netchaos:{what}", mechanism="tc")
        text = f"netchaos {what} {lk.name} {direction} " + " ".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()
        )
        layers.add_spec(
            conn,
            run_id,
            0,
            text.strip(),
            {"link": lk.name, "what": what, "direction": direction, "for_s": for_s, **params},
        )
        row = layers.fault_row(
            run_id,
            1,
            action=what,
            function=f"veth {direction}",
            library=lk.name,
            mechanism="tc",
            outcome=outcome,
            comm="gpufault",
            wall=t0,
            ts_ns=m0,
            call_seq=1,
        )
        layers.insert_faults(conn, [row])
        # lazy: keeps pyroute2 (argparse, ast, +273 modules, ~1 s) off `--help`
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            # The kernel deadline (for_s) and the watchdog that lifts the
            # impairment if this process dies first: before anything is cut.
            lk.start_watchdog()
            apply(lk)
        except (netchaos.NetChaosError, NetlinkError, OSError) as e:
            # Undone in the finally below; the fault keeps why it failed.
            outcome["error"] = str(e)
            raise netchaos.NetChaosError(f"netchaos {what}: {e}") from None
        # The window: from the impairment in place to the start of its undo.
        row["wall"], row["ts_ns"] = time.time(), time.monotonic_ns()
        if on_started is not None:
            on_started(lk, run_id)
        stop.wait(for_s)
        outcome["ended_by"] = stop.reason
        status = "done" if stop.reason == "duration" else "interrupted"
    finally:
        lifted = time.monotonic_ns()
        counters = {}
        for side, d in (("a", "a2b"), ("b", "b2a")):
            if getattr(lk, side).drop is not None:
                drops, seen = lk.drop_counters(d)
                counters[f"{d}_dropped"], counters[f"{d}_seen"] = drops, seen
        lk.close()
        if conn is not None and run_id and row:
            outcome.update(counters)
            row["outcome"] = json.dumps(outcome, sort_keys=True, default=str)
            row["latency_ns"] = lifted - row["ts_ns"]
            layers.insert_faults(conn, [row])
        if conn is not None and run_id:
            store.end_run(conn, run_id, status, None, {"faults": 1 if row else 0, **counters})
        if conn is not None:
            conn.close()
    return run_id


def partition(db: str | os.PathLike[str], *, direction: str = "both", **kw: Any) -> str:
    """Drop every packet (ARP excepted) for the window, then heal."""
    return window(
        "partition", {}, lambda lk: lk.partition(direction), db, direction=direction, **kw
    )


def delay(
    db: str | os.PathLike[str],
    delay_s: float,
    jitter_s: float = 0.0,
    *,
    direction: str = "both",
    **kw: Any,
) -> str:
    """Delay the link's packets (tc netem) by delay_s +- jitter_s."""
    ms, jit = delay_s * 1000, jitter_s * 1000
    return window(
        "delay",
        {"delay_ms": ms, "jitter_ms": jit},
        lambda lk: lk.set(delay_ms=ms, jitter_ms=jit, direction=direction),
        db,
        direction=direction,
        **kw,
    )


def loss(db: str | os.PathLike[str], pct: float, *, direction: str = "both", **kw: Any) -> str:
    """Drop pct percent (0, 100] of the packets (netem, else the BPF drop filter)."""
    return window(
        "loss",
        {"loss_pct": pct},
        lambda lk: lk.set(loss_pct=pct, direction=direction),
        db,
        direction=direction,
        **kw,
    )


def rate(db: str | os.PathLike[str], mbit: float, *, direction: str = "both", **kw: Any) -> str:
    """Limit the bandwidth to mbit Mbit/s (tbf, or netem's rate)."""
    # lazy: keeps pyctl.netchaos (ast, base64, +35 modules, ~200 ms) off `--help`
    from pyctl import netchaos

    try:
        netchaos.Impairment(rate_mbit=mbit).validate()
    except netchaos.NetChaosError as e:
        raise BadInput(f"netchaos rate: {e}") from None
    return window(
        "rate",
        {"rate_mbit": mbit},
        lambda lk: lk.set(rate_mbit=mbit, direction=direction),
        db,
        direction=direction,
        **kw,
    )


__all__ = ["Stop", "cleanup", "delay", "link", "loss", "need_root", "partition", "rate", "window"]
