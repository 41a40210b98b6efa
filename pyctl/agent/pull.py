"""`gpufault evidence pull`: each agent's store, as a consistent snapshot
over its authenticated link (AgentClient.pull_evidence), merged into one
local store (pyctl.evidence.merge) so `faults`, `show`, `timeline` and the
report read every node at once.

Snapshots land in a private 0700 directory under /var/tmp (sticky: no one
else can rename or enter it; TMPDIR is not read, it is the caller's
environment) and are removed afterwards. Runs still running on an agent
are left out (their rows are still being written): pulling again once they
end brings them, and what was pulled before is skipped as the same.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyctl.agent.client import AgentClient
from pyctl.api.errors import BadInput
from pyctl.api.evidence import merge_evidence

SNAPSHOT_DIR = "/var/tmp"


@dataclass(frozen=True)
class Pulled:
    agent: str  # its URL
    host: str  # what the agent calls itself
    bytes: int
    sha256: str
    merged: Any  # pyctl.evidence.merge.SourceStats

    def line(self) -> str:
        m = self.merged
        return (f"{self.agent} ({self.host}, {self.bytes / 1024:.0f} KiB, sha256 "
                f"{self.sha256[:12]}): {m.line().split(': ', 1)[1]}")  # fmt: skip


def pull_evidence(
    agents: Sequence[str],
    into: str | os.PathLike[str],
    **connect: Any,
) -> list[Pulled]:
    """Pull every agent's store (URLs: unix:PATH, tls://HOST:PORT; `connect`
    is AgentClient.connect's token_file/cert/key/ca/server_hostname, the
    same for all) and merge them into `into` in one transaction: a clash
    refuses the merge with `into` untouched, an agent that cannot be
    reached refuses it before anything is merged."""
    if not agents:
        raise BadInput("give the agents to pull from: gpufault evidence pull URL... --into DB")
    tmpd = tempfile.mkdtemp(prefix="gf-pull-", dir=SNAPSHOT_DIR)
    try:
        snaps: list[tuple[str, str, dict[str, Any]]] = []
        for i, url in enumerate(agents):
            path = os.path.join(tmpd, f"agent{i}.db")
            with AgentClient.connect(url, **connect) as c:
                facts = c.pull_evidence(path)
                facts["host"] = str(c.hello.get("agent") or "?")
            snaps.append((url, path, facts))
        stats = merge_evidence([p for _, p, _ in snaps], into, skip_running=True)
        return [Pulled(url, f["host"], int(f["bytes"]), str(f["sha256"]), st)
                for (url, _, f), st in zip(snaps, stats, strict=True)]  # fmt: skip
    finally:
        shutil.rmtree(tmpd, ignore_errors=True)


__all__ = ["Pulled", "pull_evidence"]
