"""`gpufault netchaos ...`: delay, loss and partitions between network
namespaces (pyctl/netchaos.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import click

from pyctl.cli.base import UserError, user_errors
from pyctl.cli.options import DURATION, db_option


@click.group(name="netchaos")
def netchaos_group() -> None:
    """Delay, loss and partitions between two network namespaces (tc, BPF)."""


@netchaos_group.command(name="cleanup")
@click.option("--all", "all_owners", is_flag=True, help="Also namespaces of live owners.")
def netchaos_cleanup(all_owners: bool) -> None:
    """Remove gf* namespaces (and their veths) left by dead processes.

    \b
    Example:
        gpufault netchaos cleanup
    """
    from pyctl import netchaos

    if os.geteuid() != 0:
        raise click.ClickException("netchaos cleanup needs root: run it with sudo")
    for name in netchaos.cleanup(all_owners=all_owners):
        click.echo(f"removed {name}")


# ---- link and impairment windows ---------------------------------------------
# `link` makes the namespaces and veth pair and holds them; `partition`,
# `delay`, `loss` and `rate` impair an existing link for a window and undo
# it at its end (--for, Ctrl-C, SIGTERM or an error). Each window is a run
# (kind netchaos:<what>) with one fault row: its parameters, start and end,
# the drop filter's counters (pyctl/evidence/layers.py renders it).

_RATE_UNITS = {
    "bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3,
    "bps": 8e-6, "kbps": 8e-3, "mbps": 8.0, "gbps": 8e3,  # tc: bytes per second
}


class RateType(click.ParamType):
    """1mbit, 500kbit, 2gbit, 100kbps (tc's units; bps = bytes/s) -> Mbit/s."""

    name = "RATE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)", value.strip())
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _RATE_UNITS:
            self.fail(f"{value!r} is not a rate: use e.g. 1mbit, 500kbit, 2gbit", param, ctx)
        return float(m.group(1)) * _RATE_UNITS[unit]


class LossType(click.ParamType):
    """5%, 0.5%, 0.05 -> a percentage in (0, 100]."""

    name = "LOSS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        t = value.strip()
        try:
            pct = float(t[:-1]) if t.endswith("%") else float(t) * 100
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            self.fail(f"{value!r} is not a loss: use e.g. 5%, 0.5%, 100% (or 0.05)", param, ctx)
        return pct


DIRECTION = click.Choice(["both", "a2b", "b2a"])


def _stop_event() -> tuple[threading.Event, dict[str, str], Callable[[], None]]:
    """An event SIGINT/SIGTERM set (with the signal's name), and the
    restore of the handlers there were before."""
    stop, why = threading.Event(), {"reason": "duration"}

    def on_signal(signo: int, _frame: object) -> None:
        why["reason"] = signal.Signals(signo).name
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return stop, why, restore


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise UserError(f"netchaos {what} needs root (network namespaces, tc): run it with sudo")


@netchaos_group.command(name="link")
@click.option("--duration", type=DURATION, default=None, help="tear down after this long"
              " (default: at Ctrl-C)")
@db_option()
@user_errors
def netchaos_link(duration: float | None, db_path: str) -> None:
    """Create two namespaces joined by a veth pair; hold them until the end.

    Prints the link's name and both ends (namespace, interface, address);
    `partition`, `delay`, `loss` and `rate` impair it meanwhile.

    \b
    Example:
        gpufault netchaos link --duration 60s &
        ip netns exec gf<pid>n<tag>a ping 10.x.y.2
    """
    from pyctl import netchaos
    from pyctl.evidence import store
    _need_root("link")
    stop, why, restore = _stop_event()
    link = netchaos.Link()
    db = None
    run_id = ""
    try:
        try:
            link.open()
        except netchaos.NetChaosError as e:
            raise UserError(f"netchaos link: {e}") from None
        db = store.open_db(db_path)
        run_id = store.new_run(db, sys.argv, "netchaos:link", mechanism="tc")
        click.echo(f"link {link.name}")
        for end in (link.a, link.b):
            click.echo(f"{end.ifname[-1]}  netns {end.ns}  dev {end.ifname}  {end.addr}/30")
        click.echo(f"run {run_id}: "
                   + (f"tearing down in {duration:g} s" if duration else "Ctrl-C tears it down"),
                   err=True)
        stop.wait(duration)
        status = "done" if why["reason"] == "duration" else "interrupted"
    except BaseException:
        status = "failed"
        raise
    finally:
        restore()
        link.close()
        if db is not None and run_id:
            store.end_run(db, run_id, status, None, {
                "link": link.name, "a": [link.a.ns, link.a.addr], "b": [link.b.ns, link.b.addr],
                "ended_by": why["reason"]})
            db.close()


def _window(
    what: str,
    link_name: str | None,
    direction: str,
    for_s: float | None,
    db_path: str,
    params: dict[str, Any],
    apply: Callable[[Any], None],
) -> None:
    """Attach, store the run and its open fault, impair, wait, undo, close
    the fault (its end, the drop counters) and the run."""
    from pyctl import netchaos
    from pyctl.evidence import layers, store

    _need_root(what)
    if what == "delay" and not netchaos.netem_available():
        raise UserError(
            "netchaos delay: this kernel lacks sch_netem: load it with `modprobe sch_netem`"
            " (CONFIG_NET_SCH_NETEM), or use loss, rate or partition")
    try:
        link = netchaos.Link.attach(link_name, for_s=for_s)
    except netchaos.NetChaosError as e:
        raise UserError(f"netchaos {what}: {e}") from None
    stop, why, restore = _stop_event()
    db = None
    run_id, status = "", "failed"
    outcome: dict[str, Any] = {"direction": direction, **params}
    row: dict[str, Any] = {}
    t0 = time.time()
    m0 = time.monotonic_ns()
    try:
        db = store.open_db(db_path)
        run_id = store.new_run(db, sys.argv, f"netchaos:{what}", mechanism="tc")
        text = f"netchaos {what} {link.name} {direction} " + " ".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
        layers.add_spec(db, run_id, 0, text.strip(), {"link": link.name, "what": what,
                                                       "direction": direction, "for_s": for_s,
                                                       **params})
        row = layers.fault_row(run_id, 1, action=what, function=f"veth {direction}",
                               library=link.name, mechanism="tc", outcome=outcome,
                               comm="gpufault", wall=t0, ts_ns=m0, call_seq=1)
        layers.insert_faults(db, [row])
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            # The kernel deadline (for_s) and the watchdog that lifts the
            # impairment if this process dies first: before anything is cut.
            link.start_watchdog()
            apply(link)
        except (netchaos.NetChaosError, NetlinkError, OSError) as e:
            # Undone in the finally below; the fault keeps why it failed.
            outcome["error"] = str(e)
            raise UserError(f"netchaos {what}: {e}") from None
        # The window: from the impairment in place to the start of its undo.
        row["wall"], row["ts_ns"] = time.time(), time.monotonic_ns()
        click.echo(f"{what} on {link.name} ({direction}): fault {run_id}-1; "
                   + (f"lifted in {for_s:g} s" if for_s else "Ctrl-C lifts it"), err=True)
        stop.wait(for_s)
        outcome["ended_by"] = why["reason"]
        status = "done" if why["reason"] == "duration" else "interrupted"
    finally:
        restore()
        lifted = time.monotonic_ns()
        counters = {}
        for side, d in (("a", "a2b"), ("b", "b2a")):
            if getattr(link, side).drop is not None:
                drops, seen = link.drop_counters(d)
                counters[f"{d}_dropped"], counters[f"{d}_seen"] = drops, seen
        link.close()
        if db is not None and run_id and row:
            outcome.update(counters)
            row["outcome"] = json.dumps(outcome, sort_keys=True, default=str)
            row["latency_ns"] = lifted - row["ts_ns"]
            layers.insert_faults(db, [row])
        if db is not None and run_id:
            store.end_run(db, run_id, status, None, {"faults": 1 if row else 0, **counters})
        if db is not None:
            db.close()


def _link_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for deco in reversed((
        click.option("--link", "link_name", default=None,
                     help="the link (gf<6 hex>, from `netchaos link`; default: the only one)"),
        click.option("--direction", type=DIRECTION, default="both", show_default=True,
                     help="a2b: traffic from a to b, b2a, or both"),
        click.option("--for", "for_s", type=DURATION, default=None,
                     help="how long: 5s, 1m30s (default: until Ctrl-C)"),
        db_option(),
    )):
        f = deco(f)
    return f


@netchaos_group.command(name="partition")
@_link_options
@user_errors
def netchaos_partition(link_name: str | None, direction: str, for_s: float | None,
                       db_path: str) -> None:
    """Drop every packet (ARP excepted) on a link for a while, then heal.

    \b
    Example:
        gpufault netchaos partition --for 5s
    """
    _window("partition", link_name, direction, for_s, db_path, {},
            lambda lk: lk.partition(direction))


@netchaos_group.command(name="delay")
@click.argument("delay", type=DURATION)
@click.option("--jitter", type=DURATION, default=None, help="jitter: 2ms")
@_link_options
@user_errors
def netchaos_delay(delay: float, jitter: float | None, link_name: str | None, direction: str,
                   for_s: float | None, db_path: str) -> None:
    """Delay a link's packets (tc netem) for a while.

    \b
    Example:
        gpufault netchaos delay 20ms --jitter 2ms --for 10s
    """
    ms, jit = delay * 1000, (jitter or 0) * 1000
    _window("delay", link_name, direction, for_s, db_path, {"delay_ms": ms, "jitter_ms": jit},
            lambda lk: lk.set(delay_ms=ms, jitter_ms=jit, direction=direction))


@netchaos_group.command(name="loss")
@click.argument("loss", type=LossType())
@_link_options
@user_errors
def netchaos_loss(loss: float, link_name: str | None, direction: str, for_s: float | None,
                  db_path: str) -> None:
    """Drop a share of a link's packets (netem, else the BPF drop filter).

    \b
    Example:
        gpufault netchaos loss 5% --direction a2b --for 30s
    """
    pct = loss
    _window("loss", link_name, direction, for_s, db_path, {"loss_pct": pct},
            lambda lk: lk.set(loss_pct=pct, direction=direction))


@netchaos_group.command(name="rate")
@click.argument("rate", type=RateType())
@_link_options
@user_errors
def netchaos_rate(rate: float, link_name: str | None, direction: str, for_s: float | None,
                  db_path: str) -> None:
    """Limit a link's bandwidth (tbf, or netem's rate) for a while.

    \b
    Example:
        gpufault netchaos rate 1mbit --for 30s
    """
    from pyctl import netchaos

    try:
        netchaos.Impairment(rate_mbit=rate).validate()
    except netchaos.NetChaosError as e:
        raise UserError(f"netchaos rate: {e}") from None
    _window("rate", link_name, direction, for_s, db_path, {"rate_mbit": rate},
            lambda lk: lk.set(rate_mbit=rate, direction=direction))
