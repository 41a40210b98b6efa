"""`gpufault netchaos ...`: delay, loss and partitions between network
namespaces (pyctl/api/netchaos.py; the kernel side is pyctl/netchaos.py).
This module parses, turns SIGINT/SIGTERM into the API's Stop, and prints."""

from __future__ import annotations

import functools
import re
import signal
import sys
from collections.abc import Callable
from typing import Any

import click

from pyctl.api import netchaos as N
from pyctl.api.errors import GpufaultError
from pyctl.cli.base import user_errors
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
    try:
        removed = N.cleanup(all_owners=all_owners)
    except GpufaultError as e:
        raise click.ClickException(str(e)) from None
    for name in removed:
        click.echo(f"removed {name}")


# ---- link and impairment windows ---------------------------------------------
# `link` makes the namespaces and veth pair and holds them; `partition`,
# `delay`, `loss` and `rate` impair an existing link for a window and undo
# it at its end (--for, Ctrl-C, SIGTERM or an error). Each window is a run
# (kind netchaos:<what>) with one fault row: its parameters, start and end,
# the drop filter's counters (pyctl/evidence/layers.py renders it).

_RATE_UNITS = {
    "bit": 1e-6,
    "kbit": 1e-3,
    "mbit": 1.0,
    "gbit": 1e3,
    "bps": 8e-6,
    "kbps": 8e-3,
    "mbps": 8.0,
    "gbps": 8e3,  # tc: bytes per second
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


def _stop_event() -> tuple[Any, Callable[[], None]]:
    """A pyctl.api.netchaos.Stop that SIGINT/SIGTERM set (with the
    signal's name), and the restore of the handlers there were before."""
    stop = N.Stop()

    def on_signal(signo: int, _frame: object) -> None:
        stop.set(signal.Signals(signo).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return stop, restore


@netchaos_group.command(name="link")
@click.option(
    "--duration", type=DURATION, default=None, help="tear down after this long (default: at Ctrl-C)"
)
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
    N.need_root("link")

    def ready(link: Any, run_id: str) -> None:
        click.echo(f"link {link.name}")
        for end in (link.a, link.b):
            click.echo(f"{end.ifname[-1]}  netns {end.ns}  dev {end.ifname}  {end.addr}/30")
        click.echo(
            f"run {run_id}: "
            + (f"tearing down in {duration:g} s" if duration else "Ctrl-C tears it down"),
            err=True,
        )

    stop, restore = _stop_event()
    try:
        N.link(db_path, duration=duration, stop=stop, argv=sys.argv, on_ready=ready)
    finally:
        restore()


def _window(what: str, for_s: float | None, direction: str, run: Callable[..., str]) -> None:
    """Run one window (pyctl.api.netchaos) with SIGINT/SIGTERM ending it."""

    def started(link: Any, run_id: str) -> None:
        click.echo(
            f"{what} on {link.name} ({direction}): fault {run_id}-1; "
            + (f"lifted in {for_s:g} s" if for_s else "Ctrl-C lifts it"),
            err=True,
        )

    stop, restore = _stop_event()
    try:
        run(stop=stop, argv=sys.argv, on_started=started)
    finally:
        restore()


def _link_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for deco in reversed(
        (
            click.option(
                "--link",
                "link_name",
                default=None,
                help="the link (gf<6 hex>, from `netchaos link`; default: the only one)",
            ),
            click.option(
                "--direction",
                type=DIRECTION,
                default="both",
                show_default=True,
                help="a2b: traffic from a to b, b2a, or both",
            ),
            click.option(
                "--for",
                "for_s",
                type=DURATION,
                default=None,
                help="how long: 5s, 1m30s (default: until Ctrl-C)",
            ),
            db_option(),
        )
    ):
        f = deco(f)
    return f


@netchaos_group.command(name="partition")
@_link_options
@user_errors
def netchaos_partition(
    link_name: str | None, direction: str, for_s: float | None, db_path: str
) -> None:
    """Drop every packet (ARP excepted) on a link for a while, then heal.

    \b
    Example:
        gpufault netchaos partition --for 5s
    """
    _window(
        "partition",
        for_s,
        direction,
        functools.partial(
            N.partition, db_path, direction=direction, link_name=link_name, for_s=for_s
        ),
    )


@netchaos_group.command(name="delay")
@click.argument("delay", type=DURATION)
@click.option("--jitter", type=DURATION, default=None, help="jitter: 2ms")
@_link_options
@user_errors
def netchaos_delay(
    delay: float,
    jitter: float | None,
    link_name: str | None,
    direction: str,
    for_s: float | None,
    db_path: str,
) -> None:
    """Delay a link's packets (tc netem) for a while.

    \b
    Example:
        gpufault netchaos delay 20ms --jitter 2ms --for 10s
    """
    _window(
        "delay",
        for_s,
        direction,
        functools.partial(
            N.delay,
            db_path,
            delay,
            jitter or 0.0,
            direction=direction,
            link_name=link_name,
            for_s=for_s,
        ),
    )


@netchaos_group.command(name="loss")
@click.argument("loss", type=LossType())
@_link_options
@user_errors
def netchaos_loss(
    loss: float, link_name: str | None, direction: str, for_s: float | None, db_path: str
) -> None:
    """Drop a share of a link's packets (netem, else the BPF drop filter).

    \b
    Example:
        gpufault netchaos loss 5% --direction a2b --for 30s
    """
    _window(
        "loss",
        for_s,
        direction,
        functools.partial(
            N.loss, db_path, loss, direction=direction, link_name=link_name, for_s=for_s
        ),
    )


@netchaos_group.command(name="rate")
@click.argument("rate", type=RateType())
@_link_options
@user_errors
def netchaos_rate(
    rate: float, link_name: str | None, direction: str, for_s: float | None, db_path: str
) -> None:
    """Limit a link's bandwidth (tbf, or netem's rate) for a while.

    \b
    Example:
        gpufault netchaos rate 1mbit --for 30s
    """
    _window(
        "rate",
        for_s,
        direction,
        functools.partial(
            N.rate, db_path, rate, direction=direction, link_name=link_name, for_s=for_s
        ),
    )
