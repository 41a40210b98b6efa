"""Experiments across nodes: the file's [agents.NAME] tables, and the
FaultHost that sends a step naming one to that node's agent.

    [agents.node-b]
    url = "tls://10.0.0.2:7450"      # or unix:/run/gpufault/agent.sock
    ca = "/etc/gpufault/ca.pem"      # TLS: the CA of the agent's certificate
    token_file = "/etc/gpufault/agent.token"
    lease = "3s"                     # the dead-man lease of its faults
    node = "gpu-b"                   # optional: what the agent must say it is
    labels = { pool = "h200" }       # optional: labels it must have

    [[method]]
    agent = { labels = { rank = "1" } }   # or { node = "gpu-b" }: chosen at start
    pid = "{rank1_pid}"
    fault = ...

    [[method]]
    agent = "node-b"
    pid = "{rank1_pid}"              # the process on that node: a number or a fact
    fault = {lib = "libnccl.so.2", fn = "ncclAllReduce", action = "stall", ...}

Each agent says what it is in its hello: its node name (`agent serve
--node-name`, the DaemonSet's spec.nodeName) and labels (`--label K=V`).
When the run starts, FleetHost.prepare reaches every agent before
anything else starts, refuses one that is not the node or lacks the
labels the file expects (a wrong url must not inject into another node),
and gives each step with a selector the one agent that matches it.

FleetHost routes each fault step: one naming an agent to that agent's
host (pyctl.agent.faulthost.AgentFaultHost, a floor above this one, found
by name when a file names agents, as the CLI's commands are), every other
step to this machine's LocalFaultHost. Every fault an agent arms is bound
to its lease: when this controller dies, each agent disarms within it.
At the end, finish() pulls each agent's evidence of the run into the
experiment's store (runs, faults, stacks), so `experiment report`,
`show` and `timeline` read every node's faults from one file.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyctl.exceptions import BadInput
from pyctl.experiment.method import agent_labels
from pyctl.experiment.reader import Reader

AGENT_KEYS = {"url", "token_file", "cert", "key", "ca", "server_name", "lease", "node", "labels"}
AGENT_HOST_MODULE = "pyctl.agent.faulthost"  # above this floor: imported by name
DEFAULT_LEASE_S = 5.0


@dataclass(frozen=True)
class AgentRef:
    name: str
    url: str
    token_file: str | None = None
    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    node: str | None = None  # what its hello must say; None: any
    labels: dict[str, str] = field(default_factory=dict)  # must be among its labels

    def connect_kw(self) -> dict[str, Any]:
        return {"token_file": self.token_file, "cert": self.cert, "key": self.key,
                "ca": self.ca, "server_hostname": self.server_name}  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """For the stored settings: where, never a secret (files by path)."""
        return {"url": self.url, "lease_s": self.lease_s,
                **{k: v for k, v in self.connect_kw().items() if v}}  # fmt: skip


def parse_agents(r: Reader, doc: dict[str, Any], base: Path) -> dict[str, AgentRef]:
    raw = doc.get("agents")
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw:
        raise r.err("agents", "expected [agents.NAME] tables with url = ...")
    out: dict[str, AgentRef] = {}
    for name, t in raw.items():
        key = f"agents.{name}"
        if not isinstance(t, dict):
            raise r.err(key, 'expected a table: [agents.NAME] url = "tls://HOST:PORT"')
        r.keys(t, key, AGENT_KEYS)
        url = r.str_(t, key, "url")
        if not url.startswith(("unix:/", "tls://")):
            raise r.err(f"{key}.url", f"{url!r}: use unix:/PATH or tls://HOST:PORT")
        files: dict[str, str | None] = {}
        for f in ("token_file", "cert", "key", "ca"):
            v = r.str_(t, key, f, "") or None
            # Relative to the experiment file, as its other paths are.
            files[f] = str(base / v) if v and not os.path.isabs(v) else v
        if url.startswith("unix:") and any(files.values()):
            raise r.err(key, "a Unix socket agent is authenticated by SO_PEERCRED: drop "
                             "token_file, cert, key and ca (they are for tls://)")  # fmt: skip
        lease = r.duration(t, key, "lease", f"{DEFAULT_LEASE_S:g}s")
        labels = agent_labels(r, t["labels"], f"{key}.labels") if "labels" in t else {}
        out[name] = AgentRef(name, url, files["token_file"], files["cert"], files["key"],
                             files["ca"], r.str_(t, key, "server_name", "") or None,
                             lease, r.str_(t, key, "node", "") or None, labels)  # fmt: skip
    return out


class AgentIdentityError(BadInput):
    """An agent is not the node the file says, or a selector matches not
    exactly one: one line, before anything starts."""


def identity(hello: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """(node, labels) an agent's hello says (older agents: its hostname)."""
    node = str(hello.get("node") or hello.get("agent") or "?")
    labels = hello.get("labels")
    return node, {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}


def describe(name: str, node: str, labels: dict[str, str]) -> str:
    lab = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{name}: node {node}" + (f" [{lab}]" if lab else "")


def check_identity(ref: AgentRef, node: str, labels: dict[str, str]) -> None:
    """The agent at ref.url is the node the file expects."""
    if ref.node is not None and node != ref.node:
        raise AgentIdentityError(
            f"agent {ref.name} ({ref.url}) is node {node!r}, the file expects {ref.node!r}: "
            "fix its url or its node"
        )
    missing = {k: v for k, v in ref.labels.items() if labels.get(k) != v}
    if missing:
        want = ",".join(f"{k}={v}" for k, v in sorted(missing.items()))
        have = ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "none"
        raise AgentIdentityError(
            f"agent {ref.name} ({ref.url}) lacks the labels {want} (it has {have}): "
            "fix its url, or its --label"
        )


def select(selector: dict[str, Any], idents: dict[str, tuple[str, dict[str, str]]],
           what: str) -> str:  # fmt: skip
    """The one agent name whose (node, labels) match selector."""
    want_node = selector.get("node")
    want = selector.get("labels") or {}
    hits = sorted(
        n for n, (node, labels) in idents.items()
        if (want_node is None or node == want_node)
        and all(labels.get(k) == v for k, v in want.items())
    )  # fmt: skip
    if len(hits) == 1:
        return hits[0]
    sel = " ".join([f"node={want_node}"] * (want_node is not None)
                   + [f"{k}={v}" for k, v in sorted(want.items())])  # fmt: skip
    agents = "; ".join(describe(n, *idents[n]) for n in sorted(idents))
    if not hits:
        raise AgentIdentityError(f"{what}: no agent is {sel} ({agents})")
    raise AgentIdentityError(
        f"{what}: {len(hits)} agents are {sel} ({', '.join(hits)}): a step arms on one "
        "node; add a label or name the agent"
    )


class FleetHost:
    """This machine's FaultHost and, per agent the file names, that
    agent's: launch/armed/start go to the step's own."""

    def __init__(self, local: Any, agents: dict[str, AgentRef], db_path: str) -> None:
        self.local = local
        self.agents = agents
        self.db_path = db_path
        self._remote: dict[str, Any] = {}
        self.name = f"{local.name} + agents {','.join(sorted(agents))}"

    def prepare(self, steps: list[Any], echo: Callable[[str], None]) -> None:
        """Before anything starts: every agent reached (its hello), checked
        against what the file expects of it, and each selector step given
        its one agent. AgentIdentityError (or the link's error) otherwise."""
        idents: dict[str, tuple[str, dict[str, str]]] = {}
        for name, ref in sorted(self.agents.items()):
            node, labels = identity(self._host(name).client().hello)
            check_identity(ref, node, labels)
            idents[name] = (node, labels)
            echo(f"  agent {describe(name, node, labels)} ({ref.url})")
        for st in steps:
            if st.agent_select is not None:
                st.agent = select(st.agent_select, idents, f"method[{st.idx + 1}] {st.name!r}")
                echo(f"  step {st.idx + 1} {st.name!r}: on agent {st.agent}")

    def _host(self, agent: str | None) -> Any:
        if not agent:
            return self.local
        h = self._remote.get(agent)
        if h is None:
            mod = importlib.import_module(AGENT_HOST_MODULE)
            h = self._remote[agent] = mod.AgentFaultHost(self.agents[agent])
        return h

    def launch(self, step: Any) -> Any:
        return self._host(step.agent).launch(step)

    def armed(self, f: Any) -> Any:
        return self._host(getattr(f, "agent", None)).armed(f)

    def start(self, step: Any) -> Any:
        return self._host(step.agent).start(step)

    def finish(self, echo: Callable[[str], None]) -> None:
        """Each agent's evidence of this run into the experiment's store,
        then its link closed (what it still had armed is disarmed)."""
        for name, h in sorted(self._remote.items()):
            try:
                line = h.pull_into(self.db_path)
                if line:
                    echo(f"  agent {name}: {line}")
            except Exception as e:  # noqa: BLE001 - the verdict stands; say what is missing
                url = self.agents[name].url
                echo(f"  agent {name}: its evidence was not pulled ({e}): "
                     f"gpufault evidence pull {url} --into {self.db_path}")  # fmt: skip
            finally:
                h.close()


__all__ = ["AGENT_KEYS", "AgentIdentityError", "AgentRef", "FleetHost", "parse_agents"]
