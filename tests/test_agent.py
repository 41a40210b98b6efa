"""The node agent (pyctl/agent/, issue 28): its wire format and token file
(no root), then a real agent process on a Unix socket arming real faults
in a gf_target: the round trip, `gpufault agent status`, a peer that is
not root refused by SO_PEERCRED, and the CLI's one-line refusals."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from agentproc import AgentProc, make_certs, probed
from click.testing import CliRunner
from conftest import requires_root
from gftarget import LIB, Target

import gpufault
from gpufault import BadInput, Fault
from pyctl.agent import protocol
from pyctl.agent.auth import read_token
from pyctl.agent.server import Listen
from pyctl.cli import cli
from pyctl.evidence import hostid
from pyctl.paths import module_argv

VICTIM = (str(LIB), "gf_victim")
TOKEN = "t" * 8 + "0123456789abcdef"


# ---- no root ------------------------------------------------------------------


def test_messages_are_typed_versioned_lines() -> None:
    line = protocol.encode("arm", 3, specs=[], target={"pid": 1})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    m = protocol.decode(line)
    assert (m.kind, m.id, m.get("target")) == ("arm", 3, {"pid": 1})
    for bad, why in ((b"hello\n", "not a JSON line"), (b"[1]\n", "JSON object"),
                     (b'{"v": 2, "kind": "arm"}\n', "version 2"),
                     (b'{"v": 1, "kind": "rm -rf"}\n', "unknown message kind"),
                     (b'{"v": 1, "kind": "arm", "id": true}\n', "id"),
                     (b"x" * (protocol.MAX_LINE + 1), "over")):  # fmt: skip
        with pytest.raises(protocol.ProtocolError, match=why):
            protocol.decode(bad)


def test_listen_addresses_refuse_plain_tcp() -> None:
    assert Listen.parse("tls://[::1]:7450").url() == "tls://[::1]:7450"
    assert Listen.parse("unix:/run/gpufault//agent.sock").path == "/run/gpufault/agent.sock"
    for bad in ("tcp://0.0.0.0:7450", "0.0.0.0:7450", "unix:agent.sock", "tls://host"):
        with pytest.raises(BadInput):
            Listen.parse(bad)


def test_a_token_file_must_be_roots_alone(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    if os.geteuid() == 0:
        assert read_token(f) == TOKEN
        os.chown(f, 65534, 65534)
        with pytest.raises(BadInput, match="owned by uid 65534"):
            read_token(f)
        os.chown(f, 0, 0)
    f.chmod(0o640)
    with pytest.raises(BadInput, match="mode 0640: others can read it"):
        read_token(f)
    f.chmod(0o600)
    (tmp_path / "link").symlink_to(f)
    with pytest.raises(BadInput, match="symbolic link"):
        read_token(tmp_path / "link")
    f.write_text("short\n")
    if os.geteuid() == 0:
        with pytest.raises(BadInput, match="at least 16 characters"):
            read_token(f)


# ---- a real agent on a Unix socket ---------------------------------------------------


@pytest.fixture
def unix_agent(tmp_path: Path):  # noqa: ANN201
    run = tmp_path / "run"
    a = AgentProc(["--listen", f"unix:{run}/agent.sock", "--db", str(tmp_path / "gf.db")])
    yield a, f"unix:{run}/agent.sock"
    assert a.stop() == 0, a.lines
    assert not (run / "agent.sock").exists()  # removed at exit


@requires_root
def test_arm_fire_and_disarm_through_a_unix_socket(
    unix_agent: tuple[AgentProc, str], target: Target, tmp_path: Path
) -> None:
    agent, url = unix_agent
    st = os.stat(tmp_path / "run")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "agent.sock").st_mode) == 0o600
    with gpufault.AgentClient.connect(url) as c:
        assert c.hello["auth"] == "unix" and c.hello["pid"] == agent.pid
        h = c.arm(Fault.fail(*VICTIM, ret=-5, sticky=True), target.pid, lease_s=2, duration=60)
        assert probed(target.pid, *VICTIM)
        assert [r[3] for r in target.victim(3)] == [-5, -5, -5]
        assert h.wait_fires(3, timeout=10)
        assert [f.function for f in h.fired()] == ["gf_victim"] * 3
        (s,) = c.sessions()
        assert (s["session"], s["run_id"], s["target"]["pid"]) == (h.session, h.run_id, target.pid)
        out = CliRunner().invoke(cli, ["agent", "status", "--agent", url])
        assert out.exit_code == 0, out.output
        assert f"{h.session} run {h.run_id} pid {target.pid} gf_victim fires 3" in out.output
        # what it says it is: its hostname (no --node-name), no labels, its ids' host part
        assert f"node {c.hello['node']} labels - ids {hostid.host_part()}..." in out.output
        assert h.run_id.startswith(c.hello["host_part"])
        h.disarm()
        assert h.ended_by == "disarmed" and not probed(target.pid, *VICTIM)
        assert [r[3] for r in target.victim(2)] == [2, 3]
        assert c.sessions() == []
    db = sqlite3.connect(tmp_path / "gf.db")
    status, stats = db.execute("SELECT status, stats FROM runs WHERE run_id = ?",
                               (h.run_id,)).fetchone()  # fmt: skip
    assert status == "done"
    why = json.loads(stats)
    assert why["agent"]["ended_by"] == "disarmed" and why["fires"] == 3  # both, whole


@requires_root
def test_agent_arm_holds_a_fault_prints_its_fires_and_disarms_on_ctrl_c(
    unix_agent: tuple[AgentProc, str], target: Target
) -> None:
    _, url = unix_agent
    p = subprocess.Popen(
        module_argv("pyctl", ["agent", "arm", "--agent", url, "--pid", str(target.pid), "--lib",
                              VICTIM[0], "--fn", "gf_victim", "--ret", "-7", "--duration", "60s",
                              "--lease", "2s"]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
    )  # fmt: skip
    assert p.stderr is not None and p.stdout is not None
    line = p.stderr.readline()
    assert line.startswith("armed session ") and "Ctrl-C to disarm" in line, line
    assert [r[3] for r in target.victim(2)] == [-7, -7]
    fires = [p.stdout.readline() for _ in range(2)]
    assert all(f.startswith("fire ") and " gf_victim " in f for f in fires), fires
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert err.strip().endswith("ended: disarmed (2 fires)"), err
    assert [r[3] for r in target.victim(1)] == [2] and not probed(target.pid, *VICTIM)


@requires_root
def test_bad_requests_are_answered_in_one_line(unix_agent: tuple[AgentProc, str]) -> None:
    _, url = unix_agent
    with gpufault.AgentClient.connect(url) as c:
        for kind, body, why in (
            ("arm", {"specs": [], "target": {"pid": 1}, "duration": 5}, "specs"),
            ("arm", {"specs": [Fault.observe(*VICTIM).to_json()], "target": {"pid": 1},
                     "duration": 0}, "every fault the agent arms ends by itself"),
            ("arm", {"specs": [Fault.observe(*VICTIM).to_json()],
                     "target": {"command": ["sh"]}, "duration": 5}, "running processes"),
            ("renew", {"session": "nope"}, "not armed here"),
            ("hello", {}, "not a request here"),
        ):  # fmt: skip
            with pytest.raises(gpufault.AgentError, match=why) as e:
                c.request(kind, **body)
            assert "\n" not in str(e.value)
        assert c.status()["sessions"] == 0  # the connection survived every refusal


@requires_root
def test_a_unix_peer_that_is_not_root_gets_one_error_line(
    unix_agent: tuple[AgentProc, str], target: Target, tmp_path: Path
) -> None:
    """The directory and the socket are opened up to everyone (a mistake
    root could make): SO_PEERCRED alone still refuses uid 65534, which gets
    one error line and nothing is armed."""
    _, url = unix_agent
    (tmp_path / "run").chmod(0o711)
    (tmp_path / "run" / "agent.sock").chmod(0o666)
    # pytest's own 0700 directories above stay closed: the peer reaches the
    # socket through a descriptor of its directory.
    dfd = os.open(tmp_path / "run", os.O_PATH | os.O_DIRECTORY)
    code = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.connect('/proc/self/fd/{dfd}/agent.sock')\n"
        'arm = b\'{"v":1,"kind":"arm","id":1,"specs":[%s],"target":{"pid":%d},'
        '"duration":30}\\n\' % (sys.argv[1].encode(), int(sys.argv[2]))\n'
        "try:\n"
        '    s.sendall(b\'{"v":1,"kind":"hello","id":0}\\n\' + arm)\n'
        "except OSError:\n"
        "    pass\n"
        "data = b''\n"
        "while chunk := s.recv(65536):\n"
        "    data += chunk\n"
        "sys.stdout.buffer.write(data)\n"
    )
    spec = json.dumps(Fault.fail(*VICTIM, ret=-5, sticky=True).to_json())
    r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                        sys.executable, "-I", "-c", code, spec, str(target.pid)],
                       capture_output=True, timeout=30, cwd="/", pass_fds=[dfd])  # fmt: skip
    os.close(dfd)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    m = protocol.decode(lines[0])
    assert m.kind == "error" and "uid 65534: only root may use the agent" in m.get("message")
    assert [x[3] for x in target.victim(2)] == [2, 3] and not probed(target.pid, *VICTIM)
    with gpufault.AgentClient.connect(url) as c:
        assert c.sessions() == []
    assert not (tmp_path / "gf.db").exists()  # no run was ever started


@requires_root
def test_a_listener_that_is_not_root_gets_nothing_from_the_client(tmp_path: Path) -> None:
    """The client's side: a fake agent of uid 65534 gets no byte (no token,
    no spec) and the client one line."""
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    dfd = os.open(d, os.O_PATH | os.O_DIRECTORY)  # past pytest's 0700 directories
    code = (
        "import socket, os, sys\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.bind('/proc/self/fd/{dfd}/agent.sock'); s.listen(1)\n"
        "print('ready', flush=True)\n"
        "c, _ = s.accept(); c.settimeout(3)\n"
        "try:\n    print(len(c.recv(65536)), flush=True)\n"
        "except OSError:\n    print(0, flush=True)\n"
    )
    os.chown(d, 65534, 65534)  # so it can bind; then root's again: only SO_PEERCRED is left
    p = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                          sys.executable, "-I", "-c", code], stdout=subprocess.PIPE, text=True,
                         cwd="/", pass_fds=[dfd])  # fmt: skip
    os.close(dfd)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        os.chown(d, 0, 0)
        with pytest.raises(gpufault.AgentRefused, match="not root: nothing sent"):
            gpufault.AgentClient.connect(f"unix:{d}/agent.sock", token="x" * 32)
        assert p.stdout.readline().strip() == "0"
    finally:
        p.kill()
        p.wait()


@requires_root
@pytest.mark.parametrize("case", ["missing cert", "token mode 0644", "token of uid 65534",
                                  "port in use", "plain tcp", "tls without auth", "label no =",
                                  "label bad key"])  # fmt: skip
def test_serve_refuses_bad_input_in_one_line(case: str, tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    tok.chmod(0o600)
    (tmp_path / "c.pem").write_text("x")
    tls = ["--listen", "tls://127.0.0.1:0", "--cert", str(tmp_path / "c.pem"), "--key",
           str(tmp_path / "c.pem")]  # fmt: skip
    busy = socket.create_server(("127.0.0.1", 0))
    args, why = {
        "missing cert": (["--listen", "tls://127.0.0.1:0", "--cert", str(tmp_path / "no.pem"),
                          "--key", str(tmp_path / "no.key"), "--token-file", str(tok)],
                         "--cert .*no.pem: no such file"),
        "token mode 0644": ([*tls, "--token-file", str(tok)], "mode 0644: others can read it"),
        "token of uid 65534": ([*tls, "--token-file", str(tok)], "owned by uid 65534"),
        "port in use": (["--listen", f"tls://127.0.0.1:{busy.getsockname()[1]}"],
                        "127.0.0.1:[0-9]+: port in use"),
        "plain tcp": (["--listen", "tcp://127.0.0.1:0"], "plain TCP is refused"),
        "tls without auth": (tls, "needs --client-ca .* or --token-file"),
        "label no =": (["--label", "rank"], "--label rank: give KEY=VALUE"),
        "label bad key": (["--label", "a b=1"], "Kubernetes' label syntax"),
    }[case]  # fmt: skip
    if case == "port in use":
        (tmp_path / "certs").mkdir()
        certs = make_certs(tmp_path / "certs")
        args += ["--cert", certs["server.pem"], "--key", certs["server.key"],
                 "--token-file", str(tok)]  # fmt: skip
    if case == "token mode 0644":
        tok.chmod(0o644)
    if case == "token of uid 65534":
        os.chown(tok, 65534, 65534)
    try:
        r = subprocess.run(module_argv("pyctl", ["agent", "serve", "--db",
                                                 str(tmp_path / "gf.db"), *args]),
                           capture_output=True, text=True, timeout=60, cwd="/")  # fmt: skip
    finally:
        busy.close()
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("gpufault: "), r.stderr
    import re

    assert re.search(why, r.stderr), r.stderr
