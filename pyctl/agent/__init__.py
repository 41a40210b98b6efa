"""gpufault's node agent (issue 28): a daemon for one node that arms and
disarms faults for remote controllers through the library API, each fault
bound to a dead-man lease; and the client those controllers use.

- protocol: the wire format (typed, versioned JSON lines)
- auth: Unix peers (SO_PEERCRED uid 0), TLS (mutual, or a bearer token)
- lease: the dead-man leases and their watcher
- server: AgentServer
- client: AgentClient, RemoteSession
- snapshot, pull: the node's store pulled into a local one (pull_evidence)

A floor above pyctl.api (it is one of the API's clients; docs/layers.md);
`import gpufault` exports its public names (gpufault.AgentClient ...).

    server = AgentServer(["unix:/run/gpufault/agent.sock"], db=DB)
    server.bind(); server.start()
    with AgentClient.connect("unix:/run/gpufault/agent.sock") as agent:
        h = agent.arm(Fault.fail(LIB, "gf_victim", ret=-5), Target.process(pid),
                      lease_s=3, duration=60)
"""

from pyctl.agent.client import AgentClient, AgentError, AgentRefused, RemoteSession
from pyctl.agent.lease import MAX_LEASE_S, MIN_LEASE_S
from pyctl.agent.pull import Pulled, pull_evidence
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
    "Pulled",
    "RemoteSession",
    "pull_evidence",
]
