"""Which library functions the reference service calls on this machine.

Starts `gpufault service` with the given options, drives it with a steady
stream of completions, and counts, in the kernel (`gpufault calls live
--count-only`), the calls of each (library, glob) pair given. Prints one
JSON object {"lib:glob": summary}. On the GPU host this tells an
experiment file which cuBLAS / driver entry points torch really uses
(cublasLt or cublas GEMMs, cuLaunchKernel or cuLaunchKernelEx).

    python -m tests.device.service_calls --service "--device cuda" \
        libcublas:'cublas*' libcublasLt:'cublasLt*' libcuda:'cuLaunch*'
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import urllib.request


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--service", default="--device cuda", help="options of gpufault service")
    ap.add_argument("--duration", default="3s")
    ap.add_argument("pairs", nargs="+", help="LIB:GLOB")
    a = ap.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    svc = subprocess.Popen(
        [sys.executable, "-m", "pyctl.service", "--port", "0", *shlex.split(a.service)],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert svc.stderr is not None
    url = None
    for line in svc.stderr:  # the readiness line, never a sleep
        sys.stderr.write(line)
        if line.startswith("serving on "):
            url = line.split()[2]
            break
    if url is None:
        print(json.dumps({"error": f"service ended: {svc.wait()}"}))
        return 1
    threading.Thread(target=lambda: [sys.stderr.write(x) for x in svc.stderr], daemon=True).start()
    stop = threading.Event()

    def load() -> None:
        body = json.dumps({"prompt": "hello world", "max_tokens": 4}).encode()
        while not stop.is_set():
            req = urllib.request.Request(
                url + "/v1/completions", body, {"Content-Type": "application/json"}
            )
            urllib.request.urlopen(req, timeout=10).read()

    t = threading.Thread(target=load, daemon=True)
    t.start()
    out: dict[str, object] = {}
    try:
        for pair in a.pairs:
            lib, glob = pair.split(":", 1)
            r = subprocess.run(
                ["gpufault", "calls", "live", "--pid", str(svc.pid), "--lib", lib, "--fn", glob,
                 "--count-only", "--duration", a.duration, "--json"],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            try:
                out[pair] = json.loads(r.stdout)
            except json.JSONDecodeError:
                out[pair] = {"rc": r.returncode, "stderr": r.stderr.strip()[-400:]}
    finally:
        stop.set()
        svc.terminate()
        svc.wait(timeout=30)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
