"""The node agent as the library sees it (pyctl/agent/): a server that
serves the session API to authenticated controllers, and the client they
use. `gpufault agent serve|status|arm` are thin commands over these.

    server = gpufault.AgentServer(["unix:/run/gpufault/agent.sock"], db=DB)
    server.bind(); server.start()
    with gpufault.AgentClient.connect("unix:/run/gpufault/agent.sock") as agent:
        h = agent.arm(Fault.fail(LIB, "gf_victim", ret=-5), Target.process(pid),
                      lease_s=3, duration=60)
"""

from __future__ import annotations

from pyctl.agent.client import AgentClient, AgentError, AgentRefused, RemoteSession
from pyctl.agent.lease import MAX_LEASE_S, MIN_LEASE_S
from pyctl.agent.server import DEFAULT_LEASE_S, DEFAULT_SOCKET, AgentServer, Listen

__all__ = [
    "AgentClient",
    "AgentError",
    "AgentRefused",
    "AgentServer",
    "DEFAULT_LEASE_S",
    "DEFAULT_SOCKET",
    "Listen",
    "MAX_LEASE_S",
    "MIN_LEASE_S",
    "RemoteSession",
]
