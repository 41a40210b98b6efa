"""Experiments across nodes (issue 28): a file's [agents.NAME] and the
steps that name one. The controller and the two-rank service in one
network namespace, two real agents (TLS with a bearer token, and a Unix
socket for the test's own looks) in two others over a netchaos link: a
stall on rank 0 through agent a, one on rank 1 through agent b; each
agent's runs are pulled into the experiment's store at the end. Then the
controller SIGKILLed mid-method: each agent disarms within its lease.
Load-time refusals need neither root nor agents."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agentproc import AgentProc, make_certs
from conftest import requires_root
from service_proc import ServiceProc

import gpufault
from pyctl.experiment import load as F
from pyctl.experiment.model import ExperimentError

GF_EXP = [sys.executable, "-m", "pyctl", "experiment"]
TOKEN = "experiment-agents-token-0123456789"


def _file(tmp_path: Path, agents: str, steps: str, duration: str = "4s",
          lease: str = "1s") -> Path:  # fmt: skip
    text = f'''
name = "two-nodes"
version = 1
title = "A stall on each rank, each through its node's agent"
slo_id = "completions-p99"

[target]
service = {{ device = "cpu-double", args = ["--ranks", "2", "--batch-wait", "0"] }}

{agents.replace("LEASE", lease)}

[load]
rate = 10.0
prompt = "hello world"
max_tokens = 4
timeout = "5s"

[phases]
warmup = "1s"
baseline = "3s"
recovery = "2s"

[steady_state]
p99 = "<= 3s"
error_rate = "<= 5%"
quorum = "50%"

{steps.replace("DURATION", duration)}

[expect]
verdict = "pass"
'''
    p = tmp_path / "two-nodes.toml"
    p.write_text(text)
    return p


STEPS = '''
[[method]]
name = "stall rank 0 synchronize"
agent = "a"
pid = "{pid}"
fault = { lib = "libcuda", fn = "cuCtxSynchronize", action = "stall", stall = "20ms", prob = "20%" }
start = "0s"
duration = "DURATION"

[[method]]
name = "stall rank 1 cond signal"
agent = "b"
pid = "{rank1_pid}"
fault = { lib = "libc.so.6", fn = "pthread_cond_signal", action = "stall", stall = "1ms", \
          prob = "1%", max = 20 }
start = "0s"
duration = "DURATION"
parallel = true
'''


# ---- the file --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("agents", "steps", "why"),
    [
        ('[agents.a]\nurl = "tls://10.0.0.1:7450"', STEPS, r"method\[2\].agent: 'b' is not one of"),
        ('[agents.a]\nurl = "http://x"\n[agents.b]\nurl = "unix:/run/a.sock"', STEPS,
         r"agents.a.url: 'http://x': use unix:/PATH or tls://HOST:PORT"),
        ('[agents.a]\nurl = "unix:/run/a.sock"\ntoken_file = "t"\n[agents.b]\nurl = "unix:/b"',
         STEPS, "authenticated by SO_PEERCRED"),
        ('[agents.a]\nurl = "unix:/run/a.sock"\nhost = "x"', STEPS, r"agents.a.host: unknown key"),
        ('[agents.a]\nurl = "unix:/run/a.sock"',
         '[[method]]\nagent = "a"\nfault = { lib = "libc.so.6", fn = "read", action = "observe" }'
         '\nduration = "1s"', "names its process on that node: pid = N"),
        ('[agents.a]\nurl = "unix:/run/a.sock"',
         '[[method]]\nagent = "a"\npid = 5\nthread = "gf-worker"\nfault = { lib = "libc.so.6", '
         'fn = "read", action = "observe" }\nduration = "1s"', "give the thread's tid instead"),
    ],
)  # fmt: skip
def test_agent_steps_are_checked_when_the_file_loads(
    tmp_path: Path, agents: str, steps: str, why: str
) -> None:
    with pytest.raises(ExperimentError, match=why) as e:
        F.load(str(_file(tmp_path, agents, steps)))
    assert "\n" not in str(e.value)


def test_relative_agent_files_are_the_files_neighbours(tmp_path: Path) -> None:
    agents = ('[agents.a]\nurl = "tls://127.0.0.1:7450"\nca = "ca.pem"\ntoken_file = "/etc/t"\n'
              'lease = "2s"\n[agents.b]\nurl = "unix:/run/b.sock"')  # fmt: skip
    exp = F.load(str(_file(tmp_path, agents, STEPS)))
    a = exp.agents["a"]
    assert (a.ca, a.token_file, a.lease_s) == (str(tmp_path / "ca.pem"), "/etc/t", 2.0)
    assert [s.agent for s in exp.steps] == ["a", "b"]


# ---- real agents -------------------------------------------------------------------------


class _Nodes:
    """Agents a and b, one per end of a netchaos link, each on TLS (the
    experiment's way in) and a Unix socket (the test's)."""

    def __init__(self, tmp_path: Path) -> None:
        # lazy: pyroute2 is a dev extra; the load-time tests above run without it
        from pyctl import netchaos

        self.netchaos = netchaos
        (tmp_path / "certs").mkdir()
        self.certs = make_certs(tmp_path / "certs")
        self.tok = tmp_path / "token"
        self.tok.write_text(TOKEN)
        self.tok.chmod(0o600)
        self.link = netchaos.Link().__enter__()
        self.agents: dict[str, AgentProc] = {}
        self.dbs: dict[str, Path] = {}
        self.unix: dict[str, str] = {}
        try:
            for name, end in (("a", self.link.a), ("b", self.link.b)):
                d = tmp_path / f"node-{name}"
                d.mkdir(mode=0o700)
                self.dbs[name] = d / "gf.db"
                self.agents[name] = AgentProc(
                    ["--listen", f"tls://{end.addr}:0", "--listen", f"unix:{d}/run/agent.sock",
                     "--cert", self.certs["server.pem"], "--key", self.certs["server.key"],
                     "--token-file", str(self.tok), "--db", str(self.dbs[name]),
                     "--node-name", f"node-{name}", "--label", f"rank={'ab'.index(name)}",
                     "--label", "pool=cpu"],
                    prefix=("nsenter", f"--net={netchaos.NETNS_DIR}/{end.ns}"),
                )  # fmt: skip
                self.unix[name] = f"unix:{d}/run/agent.sock"
        except BaseException:
            self.close()
            raise

    def agents_toml(self, **expect: str) -> str:
        """The [agents.NAME] tables; expect: NAME -> extra lines (node, labels)."""
        out = []
        for name, a in self.agents.items():
            out.append(f'[agents.{name}]\nurl = "{a.urls[0]}"\nca = "{self.certs["ca.pem"]}"\n'
                       f'token_file = "{self.tok}"\nserver_name = "localhost"\n'
                       f'lease = "LEASE"\n{expect.get(name, "")}\n')  # fmt: skip
        return "\n".join(out)

    def runner(self, *args: str) -> subprocess.Popen[str]:
        """The controller in namespace a (the service it starts is there too)."""
        ns = f"{self.netchaos.NETNS_DIR}/{self.link.a.ns}"
        return subprocess.Popen(["nsenter", f"--net={ns}", *GF_EXP, "run", *args], cwd="/",
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip

    def sessions(self, name: str) -> list[dict[str, object]]:
        with gpufault.AgentClient.connect(self.unix[name]) as c:
            return c.sessions()

    def close(self) -> None:
        for a in self.agents.values():
            assert a.stop() == 0, a.lines
        self.link.__exit__(None, None, None)


@pytest.fixture
def nodes(tmp_path: Path):  # noqa: ANN201
    pytest.importorskip("pyroute2", reason="pyroute2 is not installed: pip install -e '.[dev]'")
    n = _Nodes(tmp_path)
    yield n
    n.close()


def _rows(db: Path, sql: str, *a: object) -> list[tuple[object, ...]]:
    c = sqlite3.connect(db)
    try:
        return c.execute(sql, a).fetchall()
    finally:
        c.close()


@requires_root
def test_one_experiment_stalls_a_rank_on_each_node_and_keeps_both_nodes_evidence(
    nodes: _Nodes, tmp_path: Path
) -> None:
    # Agent a by name, checked to be node-a; rank 1's step on whichever
    # agent says it has label rank=1 (b).
    steps = STEPS.replace('agent = "b"', 'agent = { labels = { rank = "1" } }')
    f = _file(tmp_path, nodes.agents_toml(a='node = "node-a"\nlabels = { pool = "cpu" }'), steps)
    db = tmp_path / "exp.db"
    p = nodes.runner(str(f), "--db", str(db), "--json")
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0, out + "\n".join(nodes.agents["a"].lines + nodes.agents["b"].lines)
    assert "agent a: node node-a [pool=cpu,rank=0]" in out, out
    assert "step 2 'stall rank 1 cond signal': on agent b" in out, out
    for step in ("stall rank 0 synchronize", "stall rank 1 cond signal"):
        assert any(f"{step}: armed (run " in ln for ln in out.splitlines()), out
    lines = [ln.strip() for ln in out.splitlines()
             if ln.strip().startswith("agent ") and " runs, " in ln]  # fmt: skip
    assert len(lines) == 2 and all("1 runs" in ln for ln in lines), out
    (xid,) = [r[0] for r in _rows(db, "SELECT id FROM experiments")]
    steps = _rows(db, "SELECT idx, run_id, fires, status FROM experiment_steps "
                      "WHERE experiment_id=? ORDER BY idx", xid)  # fmt: skip
    assert [s[3] for s in steps] == ["done", "done"], steps
    for (idx, run_id, fires, _), agent in zip(steps, ("a", "b"), strict=True):
        # The run armed by that node's agent, in its store and, pulled, in the experiment's.
        mine = _rows(nodes.dbs[agent], "SELECT count(*) FROM faults WHERE run_id=?", run_id)
        here = _rows(db, "SELECT count(*) FROM faults WHERE run_id=?", run_id)
        assert mine == here and int(here[0][0]) == fires > 0, (idx, mine, here, fires)
        (status, kind, stats) = _rows(db, "SELECT status, kind, stats FROM runs WHERE run_id=?",
                                      run_id)[0]  # fmt: skip
        assert (status, kind) == ("done", "agent")
        assert json.loads(str(stats))["agent"]["ended_by"] in ("deadline", "disarmed")
    # Rank 1's pid was the service's fact; its agent armed there.
    (t1,) = _rows(db, "SELECT host_pid FROM targets WHERE run_id=?", steps[1][1])
    (t0,) = _rows(db, "SELECT host_pid FROM targets WHERE run_id=?", steps[0][1])
    assert t0 != t1
    show = subprocess.run([sys.executable, "-m", "pyctl", "show", f"{steps[1][1]}-1", "--db",
                           str(db)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert show.returncode == 0 and "pthread_cond_signal" in show.stdout, show.stderr
    assert nodes.sessions("a") == [] and nodes.sessions("b") == []


@requires_root
@pytest.mark.parametrize(
    ("expect", "select", "why"),
    [
        ({"b": 'node = "node-x"'}, '"b"', "agent b [(]tls://.*[)] is node 'node-b', the file "
         "expects 'node-x': fix its url or its node"),
        ({"a": 'labels = { rank = "1" }'}, '"b"',
         "agent a [(].*[)] lacks the labels rank=1 [(]it has pool=cpu,rank=0[)]"),
        ({}, '{ labels = { pool = "cpu" } }', r"method\[2\] 'stall rank 1 cond signal': 2 "
         "agents are pool=cpu [(]a, b[)]: a step arms on one node"),
        ({}, '{ node = "node-c" }', r"no agent is node=node-c [(]a: node node-a "
         r"\[pool=cpu,rank=0\]; b: node node-b \[pool=cpu,rank=1\][)]"),
    ],
)  # fmt: skip
def test_an_agent_that_is_not_the_node_expected_is_refused_before_anything_starts(
    nodes: _Nodes, tmp_path: Path, expect: dict[str, str], select: str, why: str
) -> None:
    steps = STEPS.replace('agent = "b"', f"agent = {select}")
    f = _file(tmp_path, nodes.agents_toml(**expect), steps)
    db = tmp_path / "exp.db"
    p = nodes.runner(str(f), "--db", str(db))
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 2, out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("gpufault: ")]
    assert re.search(why, line), line
    assert "experiment x" not in out and "service" not in out.lower(), out  # nothing started
    assert not db.exists() or _rows(db, "SELECT count(*) FROM experiments") == [(0,)]
    assert nodes.sessions("a") == [] and nodes.sessions("b") == []


@requires_root
def test_a_killed_controllers_faults_end_on_every_node_within_the_lease(
    nodes: _Nodes, tmp_path: Path
) -> None:
    # The service outlives its controller: started here (in namespace a),
    # given to the experiment by --url/--pid, its ranks' pids as numbers.
    lease = 1.0
    rf = tmp_path / "ready.json"
    ns = f"{nodes.netchaos.NETNS_DIR}/{nodes.link.a.ns}"
    svc = ServiceProc("--device", "cpu-double", "--ranks", "2", "--batch-wait", "0",
                      "--ready-file", str(rf), prefix=("nsenter", f"--net={ns}"))  # fmt: skip
    ready = json.loads(rf.read_text())
    steps = STEPS.replace('"{pid}"', str(svc.pid))
    steps = steps.replace('"{rank1_pid}"', str(ready["ranks"][1]["pid"]))
    f = _file(tmp_path, nodes.agents_toml(), steps, duration="60s", lease=f"{lease:g}s")
    p = nodes.runner(str(f), "--db", str(tmp_path / "exp.db"), "--url", svc.url,
                     "--pid", str(svc.pid))  # fmt: skip
    try:
        assert p.stdout is not None
        armed, seen = 0, []
        for ln in p.stdout:
            seen.append(ln)
            armed += ": armed (run " in ln
            if armed == 2:
                break
        assert armed == 2, "".join(seen)
        assert len(nodes.sessions("a")) == 1 and len(nodes.sessions("b")) == 1
        killed = time.time()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        for name in ("a", "b"):
            _ended_by_lease(nodes, name, killed, lease)
        assert svc.proc.poll() is None  # the service ran on through it
    finally:
        if p.poll() is None:
            p.kill()
        assert svc.close() == 0, "".join(svc.lines)


def _ended_by_lease(nodes: _Nodes, name: str, killed: float, lease: float) -> None:
    deadline = time.monotonic() + 15
    while nodes.sessions(name):
        assert time.monotonic() < deadline, f"agent {name} still armed"
        time.sleep(0.05)  # the agent's session list: no event reaches this process
    ((stats,),) = _rows(nodes.dbs[name], "SELECT stats FROM runs")
    why = json.loads(str(stats))["agent"]
    assert why["ended_by"] == "lease-expired", why
    # Expired by the lease (1 s from the last renewal), not the 60 s deadline.
    assert why["lease_expired_at"] - killed <= lease + 1.0, (name, why, killed)
    print(f"agent {name}: kill -> lease expiry {why['lease_expired_at'] - killed:.3f}s")
