#!/usr/bin/env bash
# Issue 26 on the GPU machine (this checkout's pyctl, build outputs carried
# in pyctl/data; the bench loop and libfiu prebuilt in build/h200: no
# compiler or libfiu there):
# 1. bench/bench_fastpath.py: signal path, copilot, libfiu, LD_PRELOAD shim
#    on the libcuda TEST DOUBLE's cuMemAlloc_v2, plain and server shapes;
# 2. the signal path on the REAL libcuda: a ctypes loop over cuMemAlloc_v2
#    (1 MiB, freed at once) in a context of the H200, every call failed with
#    2, timed in the process, signal vs copilot;
# (sustained ingest: tests/device/sustained_h200.sh.)
# Writes $OUT/fastpath-h200.json, $OUT/real-libcuda.json and their logs.
set -uo pipefail
source "$(dirname "$0")/checkout_env.sh" || exit 2
export GF_FASTPATH_EXE=$PWD/build/h200/fastpath_loop
LD_LIBRARY_PATH=$PWD/build/h200/lib:$PWD/pyctl/data/doubles python3 bench/bench_fastpath.py \
    -o $OUT/fastpath-h200.json > $OUT/fastpath.log 2>&1; echo "fastpath rc=$?"
python3 - "$LIBCUDA" "$OUT/real-libcuda.json" <<'PY' > $OUT/real.log 2>&1; echo "real rc=$?"
import json, os, subprocess, sys, tempfile, threading, time
libcuda, out = sys.argv[1:]
from pyctl.engine import Engine
from pyctl.spec import FaultSpec
TARGET = r'''
import ctypes, sys, time
cu = ctypes.CDLL(sys.argv[1])
assert cu.cuInit(0) == 0
dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), 0)
ctx = ctypes.c_void_p(); assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cu.cuCtxSetCurrent(ctx) == 0
alloc, free = cu.cuMemAlloc_v2, cu.cuMemFree_v2
ptr = ctypes.c_uint64()
print("pid", __import__("os").getpid(), flush=True)
sys.stdin.readline()  # blocked in read: the helper loads here
n = int(sys.argv[2]); ts = []; failed = 0; ns = time.perf_counter_ns
for _ in range(n):
    t = ns(); r = alloc(ctypes.byref(ptr), 1 << 20); ts.append(ns() - t)
    if r == 0: free(ptr)
    else: failed += 1
ts.sort()
print(f"p50={ts[n // 2]} p99={ts[n * 99 // 100]} failed={failed}", flush=True)
'''
res = {"libcuda": libcuda}
n = 5000
for how in ("none", "signal", "copilot"):
    p = subprocess.Popen([sys.executable, "-c", TARGET, libcuda, str(n)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    pid = int(p.stdout.readline().split()[1])
    eng = None
    if how != "none":
        spec = FaultSpec(lib=libcuda, fn="cuMemAlloc_v2", action="fail", ret=2, every=1,
                         capture_stack=False, tgid=pid)
        d = tempfile.mkdtemp(dir="/root")
        eng = Engine([spec], db_path=f"{d}/gf.db", pid=pid, argv=["h200-fastpath"],
                     mechanism="auto" if how == "signal" else "copilot")
        eng.start()
        res[f"{how}_mechanism"] = eng.mechanism
        res[f"{how}_refusal"] = getattr(eng, "signal_refusal", None)
        stop = threading.Event()
        th = threading.Thread(target=lambda: [eng.poll(timeout=0.05) for _ in iter(lambda: stop.is_set(), True)])
        th.start()
    p.stdin.write("go\n"); p.stdin.flush()
    line = p.stdout.readline().strip()
    if eng is not None:
        stop.set(); th.join(); eng.drain()
        res[f"{how}_counters"] = getattr(eng, "signal_counters", None)
        eng.close()
    p.stdin.close(); p.wait(30)
    res[how] = dict(kv.split("=") for kv in line.split())
    print(how, line, flush=True)
json.dump(res, open(out, "w"), indent=2)
PY
