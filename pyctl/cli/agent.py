"""`gpufault agent ...`: the node agent (pyctl/agent/, a floor above pyctl.api).
The commands parse options, call the library, print what comes back."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from pyctl.cli.base import UserError, user_errors
from pyctl.cli.options import DURATION, db_option

_DEFAULT_URL = "unix:/run/gpufault/agent.sock"


def _client_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """How a command reaches an agent: one bundle for status and arm."""
    fn = auth_options(fn)
    return click.option("--agent", "url", default=_DEFAULT_URL, show_default=True,
                        metavar="URL", help="unix:PATH or tls://HOST:PORT")(fn)  # fmt: skip


def auth_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """How a client proves itself to agents and checks them (TLS)."""
    for opt in reversed((
        click.option("--token-file", type=click.Path(dir_okay=False), default=None,
                     help="bearer token (a root-owned 0600 file)"),
        click.option("--cert", type=click.Path(dir_okay=False), default=None,
                     help="client certificate (mutual TLS)"),
        click.option("--key", type=click.Path(dir_okay=False), default=None,
                     help="client key (mutual TLS)"),
        click.option("--ca", type=click.Path(dir_okay=False), default=None,
                     help="CA that signed the agent's certificate"),
        click.option("--server-name", default=None, help="the name in the agent's certificate"),
    )):  # fmt: skip
        fn = opt(fn)
    return fn


def _connect(url: str, token_file: str | None, cert: str | None, key: str | None,
             ca: str | None, server_name: str | None) -> Any:  # fmt: skip
    # lazy: keeps pyctl.agent (ssl, the session API) off `--help`
    from pyctl.agent import AgentClient

    return AgentClient.connect(url, token_file=token_file, cert=cert, key=key, ca=ca,
                               server_hostname=server_name)  # fmt: skip


@click.group(name="agent")
def agent() -> None:
    """The node agent: arms faults for remote controllers, each under a lease."""


@agent.command(name="serve")
@click.option(
    "--listen",
    "listen",
    multiple=True,
    metavar="unix:PATH|tls://HOST:PORT",
    help=f"where to listen (repeatable; default {_DEFAULT_URL})",
)
@click.option(
    "--cert",
    type=click.Path(dir_okay=False),
    default=None,
    help="the agent's TLS certificate (PEM)",
)
@click.option("--key", type=click.Path(dir_okay=False), default=None, help="its key (PEM)")
@click.option(
    "--client-ca",
    type=click.Path(dir_okay=False),
    default=None,
    help="require client certificates signed by this CA (mutual TLS)",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="require this bearer token on TLS (a root-owned 0600 file)",
)
@click.option(
    "--lease",
    "lease_s",
    type=DURATION,
    default="10s",
    show_default=True,
    help="lease of an arm that names none",
)
@click.option("--node-name", default=None, metavar="NAME",
              help="what this node says it is (default: its hostname; the DaemonSet: "
                   "spec.nodeName)")  # fmt: skip
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="a label controllers select this agent by (repeatable)")
@db_option()
@user_errors
def serve(listen: tuple[str, ...], cert: str | None, key: str | None, client_ca: str | None,
          token_file: str | None, lease_s: float, node_name: str | None,
          labels: tuple[str, ...], db_path: str) -> None:  # fmt: skip
    """Serve the agent's API until SIGTERM or Ctrl-C (docs/fleet.md).

    Every fault it arms is bound to a lease the controller renews; when the
    renewals stop, the fault is disarmed at the lease's end.

    \b
    Examples:
        gpufault agent serve
        gpufault agent serve --listen tls://0.0.0.0:7450 --cert node.pem --key node.key \\
            --client-ca ca.pem --token-file /etc/gpufault/agent.token
    """
    # lazy: keeps pyctl.agent off `--help`
    from pyctl.agent import AgentServer

    if os.geteuid() != 0:
        raise UserError("agent serve needs root (it arms BPF faults): run it with sudo")
    pairs = {}
    for lab in labels:
        k, eq, v = lab.partition("=")
        if not eq:
            raise UserError(f"--label {lab}: give KEY=VALUE, e.g. --label rank=1")
        pairs[k] = v
    server = AgentServer(
        list(listen) or [_DEFAULT_URL], db=db_path, cert=cert, key=key, client_ca=client_ca,
        token_file=token_file, default_lease_s=lease_s,
        log=lambda s: click.echo(f"agent: {s}", err=True), node=node_name, labels=pairs,
    )  # fmt: skip
    server.bind()

    server.stop_on_signals()
    try:

        def ready() -> None:
            click.echo(f"agent: listening on {' '.join(server.urls)} (pid {os.getpid()}); "
                       "SIGTERM or Ctrl-C to stop", err=True)  # fmt: skip
            sys.stderr.flush()

        server.serve_forever(ready)
    finally:
        server.close()


@agent.command(name="status")
@_client_options
@click.option("--json", "as_json", is_flag=True, help="the status and sessions as JSON")
@user_errors
def status(url: str, token_file: str | None, cert: str | None, key: str | None,
           ca: str | None, server_name: str | None, as_json: bool) -> None:  # fmt: skip
    """What an agent runs: its version, uptime and armed sessions.

    \b
    Examples:
        gpufault agent status
        gpufault agent status --agent tls://node7:7450 --ca ca.pem --token-file t
    """
    with _connect(url, token_file, cert, key, ca, server_name) as c:
        st, sessions = c.status(), c.sessions()
    if as_json:
        click.echo(json.dumps({"status": st, "sessions": sessions}, indent=2, sort_keys=True))
        return
    click.echo(f"agent {st['agent']} pid {st['pid']} gpufault {st['version']} "
               f"up {st['uptime_s']:.0f}s, {st['sessions']} session(s), db {st['db']}")  # fmt: skip
    if "node" in st:  # older agents say only their hostname
        labels = ",".join(f"{k}={v}" for k, v in sorted(st.get("labels", {}).items()))
        click.echo(f"  node {st['node']} labels {labels or '-'} ids {st.get('host_part')}...")
    for s in sessions:
        click.echo(f"  {s['session']} run {s['run_id']} pid {s['target'].get('pid') or '-'} "
                   f"{','.join(s['functions'])} fires {s['fires']} lease {s['lease_s']:g}s "
                   f"({s['peer']})")  # fmt: skip


@agent.command(name="arm")
@_client_options
@click.option("--pid", type=int, default=None, help="the process on the agent's node")
@click.option("--pod", default=None, metavar="NAMESPACE/NAME[/CONTAINER]",
              help="or the process of a pod on that node (resolved there)")
@click.option("--container", default=None, metavar="ID|NAME",
              help="or the process of a container on that node")
@click.option("--comm", default=None, metavar="NAME", help="or the process of that name there")
@click.option("--lib", required=True, help="library (name or path on the node)")
@click.option("--fn", required=True, help="function (name or glob)")
@click.option("--ret", default=None, help="fail with this value (a number or a CUDA name)")
@click.option("--duration", type=DURATION, required=True, help="the fault's deadline")
@click.option("--lease", "lease_s", type=DURATION, default="10s", show_default=True,
              help="the dead-man lease: renewed every third of it while this runs")
@user_errors
def arm(url: str, token_file: str | None, cert: str | None, key: str | None, ca: str | None,
        server_name: str | None, pid: int | None, pod: str | None, container: str | None,
        comm: str | None, lib: str, fn: str, ret: str | None, duration: float,
        lease_s: float) -> None:  # fmt: skip
    """Arm one fault through an agent and hold it (renewing its lease) until
    its deadline or Ctrl-C; each fire is printed as it streams in.

    \b
    Example:
        gpufault agent arm --pid 1234 --lib libcuda --fn cuMemAlloc_v2 \\
            --ret CUDA_ERROR_OUT_OF_MEMORY --duration 30s
        gpufault agent arm --agent tls://node7:7450 --ca ca.pem --token-file t \\
            --pod serving/llm-0 --lib libcuda --fn cuMemAlloc_v2 --ret 2 --duration 30s
    """
    # lazy: the spec builder and the target only when this runs
    from pyctl.api.faults import Fault
    from pyctl.api.target import Target

    given = {k: v for k, v in (("pid", pid), ("pod", pod), ("container", container),
                               ("comm", comm)) if v is not None}  # fmt: skip
    if len(given) != 1:
        raise UserError("agent arm: give one of --pid, --pod, --container, --comm")
    ((what, value),) = given.items()
    target = Target(pid=pid) if pid is not None else Target(selector=what, value=str(value))
    spec = Fault.fail(lib, fn, ret=ret) if ret is not None else Fault.observe(lib, fn)
    with _connect(url, token_file, cert, key, ca, server_name) as c:
        h = c.arm(spec, target, duration=duration, lease_s=lease_s,
                  on_fire=functools.partial(_print_fire))  # fmt: skip
        where = f"pid {pid}" if pid is not None else f"{what} {value}"
        click.echo(f"armed session {h.session} run {h.run_id} in {where} on "
                   f"{c.hello.get('node') or c.hello['agent']} (lease {h.lease_s:g}s); "
                   "Ctrl-C to disarm", err=True)  # fmt: skip
        try:
            h.wait()
        except KeyboardInterrupt:
            pass
        finally:
            h.disarm()
        click.echo(f"ended: {h.ended_by} ({h.counters.fires} fires)", err=True)


def _print_fire(f: Any) -> None:
    click.echo(f"fire {f.fault_id} {f.function} tid {f.tid} {f.action}")
