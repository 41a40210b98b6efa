"""The threaded-server shape of target for bench/bench_copilot.py --shape
server (issue 26): a CPython process like a small inference server. One
worker thread makes the "GPU" calls (the libcuda TEST DOUBLE's
cuMemAlloc_v2 through ctypes, which drops the GIL around the call, as
torch does); the other threads are where a ThreadingHTTPServer's are:
its serve_forever thread in poll, one handler thread per idle keep-alive
connection blocked in recv, a thread blocked in accept() on a second
socket, and a Python thread that takes the GIL for ~1 ms of every 2 ms
(request parsing, JSON, sampling; GF_SHAPE_GIL=0 leaves it out). With
GF_SHAPE_TORCH=1 it imports torch first (the maps and the symbol tables a
real one has).

Protocol on stdin/stdout, one line each: prints "ready PID"; "go N GAP_US"
runs N calls GAP_US apart and prints "done " + JSON (each call's ns and
return code); "quit" ends it.
"""

from __future__ import annotations

import ctypes
import http.server
import json
import os
import socket
import sys
import threading
import time

if os.environ.get("GF_SHAPE_TORCH") == "1":
    import torch  # noqa: F401  - the maps and libraries of a torch server

LIB = ctypes.CDLL(sys.argv[1])
ALLOC = LIB.cuMemAlloc_v2
ALLOC.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
ALLOC.restype = ctypes.c_int
IDLE_CONNECTIONS = 8


class Quiet(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: each handler thread waits in recv

    def log_message(self, *a: object) -> None:
        pass


def server_threads() -> list[socket.socket]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=srv.serve_forever, name="serve", daemon=True).start()
    clients = [socket.create_connection(srv.server_address) for _ in range(IDLE_CONNECTIONS)]
    lst = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lst.accept, name="accept", daemon=True).start()
    return [*clients, lst]


def gil_holder() -> None:
    while True:
        end = time.perf_counter() + 0.001
        n = 0
        while time.perf_counter() < end:
            n += 1  # pure Python: holds the GIL
        time.sleep(0.001)


def run(n: int, gap_us: int) -> dict[str, list[int]]:
    out = ctypes.c_uint64()
    ns, rc = [], []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        r = ALLOC(ctypes.byref(out), 64)
        ns.append(time.perf_counter_ns() - t0)
        rc.append(r)
        end = time.perf_counter_ns() + gap_us * 1000
        time.sleep(gap_us / 1e6 / 2)
        while time.perf_counter_ns() < end:
            pass
    return {"ns": ns, "rc": rc}


def main() -> None:
    keep = server_threads()
    if os.environ.get("GF_SHAPE_GIL", "1") == "1":
        threading.Thread(target=gil_holder, name="python-work", daemon=True).start()
    print("ready", os.getpid(), flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[:1] == ["go"]:
            got: list[dict[str, list[int]]] = []
            n, gap = int(words[1]), int(words[2])
            # A new thread per batch, as a server makes one per request.
            worker = threading.Thread(
                target=lambda n=n, gap=gap, got=got: got.append(run(n, gap)), name="gpu-worker"
            )
            worker.start()
            worker.join()
            print("done", json.dumps(got[0]), flush=True)
        elif words[:1] == ["quit"]:
            break
    del keep


if __name__ == "__main__":
    main()
