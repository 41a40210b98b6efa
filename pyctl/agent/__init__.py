"""gpufault's node agent (issue 28): a daemon for one node that arms and
disarms faults for remote controllers through the library API, each fault
bound to a dead-man lease.

- protocol: the wire format (typed, versioned JSON lines)
- auth: Unix peers (SO_PEERCRED uid 0), TLS (mutual, or a bearer token)
- lease: the dead-man leases and their watcher
- server: AgentServer
- client: AgentClient, RemoteSession

The public names are exported by pyctl.api (gpufault.AgentClient ...).
"""
