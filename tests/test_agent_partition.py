"""The lease across a cut link: the agent in one network namespace, its
controller in the other (a netchaos veth pair, pyctl/netchaos.py), real
TLS with a bearer token between them. The link is partitioned while the
fault fails every gf_empty call of a running gf_target: the renewals stop
reaching the agent, and the fault ends within the lease (measured from
the evidence's fire times); the controller learns it once the link heals."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

import pytest
from agentproc import AgentProc, make_certs, probed
from conftest import requires_root
from gftarget import LIB, Target

import gpufault
from gpufault import Fault

pytest.importorskip("pyroute2", reason="pyroute2 is not installed: pip install -e '.[dev]'")

from pyctl import netchaos  # noqa: E402

EMPTY = (str(LIB), "gf_empty")
LEASE_S = 1.0
# The goal (expiry to the last fire within 0.1 s) is bench/bench_agent.py's;
# this bound only tells "ended by the lease" from "ended by the deadline".
SLACK_S = 1.0
TOKEN = "partition-test-token-0123456789"


@requires_root
def test_a_partitioned_controllers_fault_stops_within_the_lease(
    target: Target, tmp_path: Path
) -> None:
    (tmp_path / "certs").mkdir()
    certs = make_certs(tmp_path / "certs")
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    tok.chmod(0o600)
    db = tmp_path / "gf.db"
    with netchaos.Link() as link:
        agent = AgentProc(
            ["--listen", f"tls://{link.b.addr}:0", "--cert", certs["server.pem"], "--key",
             certs["server.key"], "--token-file", str(tok), "--db", str(db)],
            prefix=("nsenter", f"--net={netchaos.NETNS_DIR}/{link.b.ns}"),
        )  # fmt: skip
        try:
            url = agent.urls[0]
            assert url.startswith(f"tls://{link.b.addr}:")
            # The client's socket is made in namespace a (a socket keeps its namespace).
            c = netchaos.run_in_netns(link.a.ns, lambda: gpufault.AgentClient.connect(
                url, ca=certs["ca.pem"], token_file=tok, server_hostname="localhost"))  # fmt: skip
            spec = Fault.fail(*EMPTY, ret=-5, sticky=True, stack=False)
            h = c.arm(spec, target.pid, lease_s=LEASE_S, duration=60)
            assert target.p.stdin is not None
            target.p.stdin.write("pace 1600 400\n")  # 4 s of calls, each failed while armed
            target.p.stdin.flush()
            assert h.wait_fires(50, timeout=10)
            deadline = time.monotonic() + 10
            while c.sessions()[0]["renewals"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)  # the agent's renewal count: no event to await here
            cut = time.time()
            link.partition()
            for _ln in iter(target.p.stdout.readline, "done\n"):  # type: ignore[union-attr]
                pass  # the workload ran to its end through the partition
            link.heal()
            assert h.wait(40), "the controller never learnt the session ended"
            assert h.ended_by in ("lease-expired", "lease-lost"), h.ended_by
            c.close(disarm=False)
        finally:
            assert agent.stop() == 0, agent.lines
    d = sqlite3.connect(db)
    (run,) = d.execute("SELECT run_id, status, stats FROM runs").fetchall()
    walls = [w for (w,) in d.execute("SELECT wall FROM faults ORDER BY wall")]
    d.close()
    why = json.loads(run[2])["agent"]
    assert run[1] == "done" and why["ended_by"] == "lease-expired"
    expired, last = why["lease_expired_at"], walls[-1]
    print(f"cut->expiry {expired - cut:.3f}s, expiry->last fire {last - expired:.3f}s, "
          f"fires after the cut {sum(w > cut for w in walls)}")  # fmt: skip
    assert expired - cut <= LEASE_S + SLACK_S
    assert sum(w > cut + 0.2 for w in walls) > 0  # live until the lease ended it
    assert last - cut <= LEASE_S + 2 * SLACK_S
    assert [r[3] for r in target.victim(2)] == [2, 3] and not probed(target.pid, *EMPTY)
    assert os.path.exists(db)
