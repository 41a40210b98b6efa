"""The agent over TCP is TLS only, and refuses every controller it cannot
authenticate: no token or a wrong one (one error line, then the close),
a client certificate from another CA or none (the handshake fails), plain
TCP. Each refused client tried to arm a sticky fail in a real gf_target:
it never fires, no run is written. Certificates: the openssl CLI."""

from __future__ import annotations

import json
import socket
import ssl
from pathlib import Path

import pytest
from agentproc import AgentProc, make_certs, probed
from conftest import requires_root
from gftarget import LIB, Target

import gpufault
from gpufault import Fault
from pyctl.agent import protocol

VICTIM = (str(LIB), "gf_victim")
TOKEN = "agent-test-token-0123456789abcdef"

pytestmark = requires_root


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def tls_agent(tmp_path: Path, certs: dict[str, str], request: pytest.FixtureRequest):  # noqa: ANN201
    tok = tmp_path / "token"
    tok.write_text(TOKEN + "\n")
    tok.chmod(0o600)
    mode = request.param
    args = ["--listen", "tls://127.0.0.1:0", "--cert", certs["server.pem"], "--key",
            certs["server.key"], "--db", str(tmp_path / "gf.db")]  # fmt: skip
    args += ["--token-file", str(tok)] if mode == "token" else ["--client-ca", certs["ca.pem"]]
    a = AgentProc(args)
    yield a, a.urls[0], tok
    assert a.stop() == 0, a.lines


def _nothing_armed(target: Target, db: Path) -> None:
    assert [r[3] for r in target.victim(2)] == [2, 3] and not probed(target.pid, *VICTIM)
    assert not db.exists()  # not even a run row


def _raw_tls(url: str, certs: dict[str, str], lines: list[bytes]) -> list[bytes]:
    """A hand-made client: TLS (the agent's CA trusted), then `lines`; what
    comes back until the agent closes."""
    host, port = url[len("tls://") :].rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=certs["ca.pem"])
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as s:
            try:
                s.sendall(b"".join(lines))
            except OSError:
                pass
            data = b""
            try:
                while chunk := s.recv(65536):
                    data += chunk
            except (OSError, ssl.SSLError):
                pass
    return data.splitlines()


def _arm_line(pid: int) -> bytes:
    spec = Fault.fail(*VICTIM, ret=-5, sticky=True).to_json()
    return protocol.encode("arm", 2, specs=[spec], target={"pid": pid}, duration=30)


@pytest.mark.parametrize("tls_agent", ["token"], indirect=True)
@pytest.mark.parametrize("token", [None, "agent-test-token-0123456789abcdeX", TOKEN[:-1]])
def test_a_wrong_or_missing_token_gets_one_error_line_and_nothing(
    tls_agent: tuple[AgentProc, str, Path], certs: dict[str, str], target: Target,
    tmp_path: Path, token: str | None,
) -> None:  # fmt: skip
    _, url, _ = tls_agent
    hello = protocol.encode("hello", 1, **({"token": token} if token else {}))
    got = _raw_tls(url, certs, [hello, _arm_line(target.pid)])
    assert len(got) == 1, got
    m = protocol.decode(got[0])
    assert m.kind == "error" and m.get("message") == "refused: bad or missing token"
    with pytest.raises(gpufault.AgentRefused, match="bad or missing token"):
        gpufault.AgentClient.connect(url, ca=certs["ca.pem"], token=token or "")
    _nothing_armed(target, tmp_path / "gf.db")


@pytest.mark.parametrize("tls_agent", ["token"], indirect=True)
def test_an_arm_before_hello_and_plain_tcp_get_nothing(
    tls_agent: tuple[AgentProc, str, Path], certs: dict[str, str], target: Target,
    tmp_path: Path,
) -> None:  # fmt: skip
    _, url, _ = tls_agent
    got = _raw_tls(url, certs, [_arm_line(target.pid)])
    assert [json.loads(x)["message"] for x in got] == ["refused: say hello first"]
    host, port = url[len("tls://") :].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:  # no TLS
        s.sendall(protocol.encode("hello", 1, token=TOKEN) + _arm_line(target.pid))
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError:
            pass
    assert b"kind" not in data  # at most a TLS alert, never one of our messages
    _nothing_armed(target, tmp_path / "gf.db")


@pytest.mark.parametrize("tls_agent", ["token"], indirect=True)
def test_the_right_token_arms(
    tls_agent: tuple[AgentProc, str, Path], certs: dict[str, str], target: Target
) -> None:
    _, url, tok = tls_agent
    with gpufault.AgentClient.connect(url, ca=certs["ca.pem"], token_file=tok) as c:
        assert c.hello["auth"] == "token"
        h = c.arm(Fault.fail(*VICTIM, ret=-5, sticky=True), target.pid, duration=30)
        assert [r[3] for r in target.victim(2)] == [-5, -5] and h.wait_fires(2, 10)
    assert h.ended_by == "disarmed" and not probed(target.pid, *VICTIM)


@pytest.mark.parametrize("tls_agent", ["mtls"], indirect=True)
def test_mutual_tls_needs_a_certificate_of_its_ca(
    tls_agent: tuple[AgentProc, str, Path], certs: dict[str, str], target: Target,
    tmp_path: Path,
) -> None:  # fmt: skip
    agent, url, _ = tls_agent
    for cert in ("rogue", None):  # signed by another CA; none at all
        kw = {"cert": certs[f"{cert}.pem"], "key": certs[f"{cert}.key"]} if cert else {}
        with pytest.raises(gpufault.AgentError):
            c = gpufault.AgentClient.connect(url, ca=certs["ca.pem"], **kw)  # type: ignore[arg-type]
            c.arm(Fault.fail(*VICTIM, ret=-5, sticky=True), target.pid, duration=30)
    _nothing_armed(target, tmp_path / "gf.db")
    assert sum("handshake" in ln for ln in agent.lines) >= 2, agent.lines
    with gpufault.AgentClient.connect(url, ca=certs["ca.pem"], cert=certs["client.pem"],
                                      key=certs["client.key"]) as c:  # fmt: skip
        assert c.hello["auth"] == "mtls"
        h = c.arm(Fault.fail(*VICTIM, ret=-5, sticky=True), target.pid, duration=30)
        assert [r[3] for r in target.victim(1)] == [-5]
        assert c.sessions()[0]["peer"].endswith("(CN=gf-test-client)")
    assert not probed(target.pid, *VICTIM) and h.ended_by == "disarmed"
