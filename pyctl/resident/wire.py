"""What `gpufault trace` and `gpufault serve` say to each other over one
Unix stream socket. Light on purpose: the client side runs before any of
the CLI is imported, so this uses nothing but os, struct and sys.

Request (client -> server), one sendmsg carrying the client's stdin,
stdout and stderr as SCM_RIGHTS, then the rest of the bytes if any:
  u32 length, then NUL-separated fields:
  "gf1", fingerprint, cwd, umask (octal), argc, argv..., "K=V" env items...
  or the body b"ping" (no descriptors): `gpufault doctor` asking
Replies (server -> client):
  b"P" u32 length, "PID\0FINGERPRINT"  the answer to a ping
  b"N" u32 length, reason   not served: the client runs the command itself
  b"S" u32 pid              served: pid is the controller's
  signal bytes go the other way (client -> controller): one byte each
  b"X" i32 status           the controller's exit status, its last word
"""

from __future__ import annotations

import os
import struct
import sys

from pyctl import rundir

VERSION = "gf1"
LEN = struct.Struct("=I")
STATUS = struct.Struct("=i")
FDS = struct.Struct("=3i")  # SCM_RIGHTS: the client's stdin, stdout, stderr
SOCKET_NAME = "serve.sock"
# Signals the client passes on to the controller: what ends a run
# (Ctrl-C, kill, a closed terminal) and what dumps it (Ctrl-\).
FORWARDED = (2, 15, 1, 3)  # SIGINT, SIGTERM, SIGHUP, SIGQUIT

# Environment read when a module is imported, not when a command runs: a
# controller forked from the server has the server's values of these, so
# a request whose values differ is not served (it runs in-process).
# tests/test_resident.py finds every module-level environment read in
# pyctl and fails if one is missing here. PYTHON* variables (PYTHONPATH,
# ...) shape the imports themselves and are compared too.
IMPORT_TIME_ENV = (
    "GPUFAULT_DEBUG",
    "GPUFAULT_RUN_DIR",
    "GPUFAULT_FIRES_RING_BYTES",
    "GPUFAULT_STACK_COPY_BYTES",
    "GPUFAULT_NO_EARLY_LOAD",
    "GPUFAULT_CALL_ROWS_PER_INSERT",
)


def socket_path() -> str:
    """Where the server listens: beside the controllers' release sockets
    (pyctl/control.py), in the root-only run directory."""
    return os.path.join(rundir.path(), SOCKET_NAME)


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k in IMPORT_TIME_ENV or k.startswith("PYTHON")}


def fingerprint() -> str:
    """Which code this is: the interpreter, and the number and newest
    modification time of the package's modules and BPF objects. A server
    started before gpufault was upgraded or edited differs, and refuses
    (a stale controller must not answer for new code). ~1 ms."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    count, newest = 0, 0
    stack = [root]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    if e.name != "__pycache__":
                        stack.append(e.path)
                elif e.name.endswith((".py", ".o")):
                    count += 1
                    newest = max(newest, e.stat().st_mtime_ns)
    return f"{sys.executable}|{sys.version}|{root}|{count}|{newest}"


def encode_request(argv: list[str], cwd: str, umask: int, env: dict[str, str], fp: str) -> bytes:
    fields = [VERSION, fp, cwd, f"{umask:o}", str(len(argv)), *argv]
    fields += [f"{k}={v}" for k, v in env.items()]
    body = "\0".join(fields).encode("utf-8", "surrogateescape")
    return LEN.pack(len(body)) + body


class BadRequest(Exception):
    pass


def decode_request(body: bytes) -> tuple[str, str, int, list[str], dict[str, str]]:
    """(fingerprint, cwd, umask, argv, env); raises BadRequest."""
    f = body.decode("utf-8", "surrogateescape").split("\0")
    try:
        if f[0] != VERSION:
            raise BadRequest(f"protocol {f[0]!r}, expected {VERSION}")
        fp, cwd, umask, argc = f[1], f[2], int(f[3], 8), int(f[4])
        argv = f[5 : 5 + argc]
        if len(argv) != argc:
            raise BadRequest("argv cut short")
        env = dict(item.split("=", 1) for item in f[5 + argc :] if item)
    except (IndexError, ValueError) as e:
        raise BadRequest(f"malformed request: {e}") from None
    return fp, cwd, umask, argv, env


PING = b"ping"
# The server's first byte on an accepted connection: a client sends its
# request (and descriptors) only after it (client._await_hello).
HELLO = b"H"


def pong(pid: int, fp: str) -> bytes:
    b = f"{pid}\0{fp}".encode("utf-8", "surrogateescape")
    return b"P" + LEN.pack(len(b)) + b


def not_served(reason: str) -> bytes:
    b = reason.encode()
    return b"N" + LEN.pack(len(b)) + b
