"""Who may talk to the node agent, and how that is checked.

- A Unix socket, in a directory that is root's alone (created 0700, never
  chmod-ed, checked on its descriptor: pyctl/rundir.py), and a peer whose
  SO_PEERCRED uid is 0. A file mode is not the check: the kernel's
  credentials of the connecting process are.
- TCP, always TLS (no plain TCP listener exists): mutual TLS with client
  certificates signed by the given CA, and/or a bearer token read from a
  root-owned 0600 file, compared with hmac.compare_digest. A TLS listener
  with neither is refused: TLS alone authenticates the agent, not the
  controller.
"""

from __future__ import annotations

import hmac
import os
import socket
import ssl
from dataclasses import dataclass

from pyctl.api.errors import BadInput
from pyctl.rundir import peer_cred
from pyctl.safefile import SafeFileError, read_checked

MIN_TOKEN = 16  # characters; a shorter secret is guessable over a fast link
MAX_TOKEN_FILE = 4096


# SafeFileError.why -> the token file's words
_WHY = {
    "link": " is a symbolic link: give the file itself",
    "open": ": {d}",
    "type": " is not a regular file",
    "owner": " is owned by uid {d}: it must be root's",
    "mode": " has mode {d}: others can read it (chmod 600 {p})",
    "size": " is over " + str(MAX_TOKEN_FILE) + " bytes: one token, one line",
    "read": ": {d}",
}


def read_token(path: str | os.PathLike[str]) -> str:
    """The token in `path`: a regular file (its name no symlink), owned by
    root, readable by nobody else (mode 0600 or stricter), checked on the
    open descriptor, at least MIN_TOKEN characters. BadInput otherwise."""
    p = os.fspath(path)
    try:
        data = read_checked(p, MAX_TOKEN_FILE, owner=0, private=True)
    except SafeFileError as e:
        raise BadInput(f"token file {p}{_WHY[e.why].format(d=e.detail, p=p)}") from None
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise BadInput(f"token file {p}: the token is not ASCII") from None
    if len(token) < MIN_TOKEN or any(c.isspace() for c in token):
        raise BadInput(
            f"token file {p}: a token is one word of at least {MIN_TOKEN} characters "
            "(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


def token_matches(given: object, expected: str) -> bool:
    """Constant-time comparison; anything but a string is no match."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def _readable(path: str | None, what: str) -> str:
    if not path:
        raise BadInput(f"{what}: give a file")
    p = os.fspath(path)
    if not os.path.isfile(p):
        raise BadInput(f"{what} {p}: no such file")
    return p


def server_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """TLS 1.2 or later; with client_ca a client certificate signed by it is
    required (the handshake fails without one)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(_readable(cert, "--cert"), _readable(key, "--key"))
        if client_ca:
            ctx.load_verify_locations(cafile=_readable(client_ca, "--client-ca"))
            ctx.verify_mode = ssl.CERT_REQUIRED
    except ssl.SSLError as e:
        raise BadInput(f"TLS: cannot load the certificate or key: {e.reason or e}") from None
    return ctx


def client_context(
    ca: str | None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext:
    """Verifies the agent against `ca` (the system's store when None) and its
    name; presents `cert`/`key` for mutual TLS."""
    ctx = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=_readable(ca, "ca") if ca else None
    )
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert or key:
        try:
            ctx.load_cert_chain(_readable(cert, "cert"), _readable(key, "key"))
        except ssl.SSLError as e:
            raise BadInput(f"TLS: cannot load the client certificate: {e.reason or e}") from None
    return ctx


@dataclass(frozen=True)
class Peer:
    """Who is connected: a Unix peer's pid and uid, or a TCP address and
    the subject of its certificate."""

    transport: str  # unix, tls
    address: str
    uid: int | None = None
    pid: int | None = None
    subject: str = ""

    def describe(self) -> str:
        if self.transport == "unix":
            return f"unix peer pid {self.pid} uid {self.uid}"
        who = f" ({self.subject})" if self.subject else ""
        return f"tls peer {self.address}{who}"


def unix_peer(s: socket.socket) -> Peer:
    pid, uid = peer_cred(s)
    return Peer("unix", "", uid=uid, pid=pid)


def tls_subject(s: ssl.SSLSocket) -> str:
    cert = s.getpeercert()
    if not cert:
        return ""
    for rdn in cert.get("subject", ()):
        for pair in rdn:
            if pair[0] == "commonName":
                return f"CN={pair[1]}"
    return ""


__all__ = ["MIN_TOKEN", "Peer", "client_context", "read_token", "server_context",
           "tls_subject", "token_matches", "unix_peer"]  # fmt: skip
