"""`gpufault serve`: a resident controller that `gpufault trace --pid` and
`inject --pid` hand themselves to, so their start-up skips the imports and
the BPF load (docs/resident.md).

  wire.py    the socket's path and the request and reply formats; light
             (the client imports it before anything else)
  client.py  the `gpufault` side: hand the command over, forward signals,
             return its exit status; falls back to running in-process
  server.py  the server: accept, check, fork a controller per request
"""
