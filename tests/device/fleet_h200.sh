#!/usr/bin/env bash
# Issue 28 on the GPU machine, with the real driver (this checkout's pyctl,
# its build outputs carried in pyctl/data):
# 1. the reference service on CUDA under load; `inject --ranks-of` and
#    `--comm` select it (one process: the ordinary run) and its targets
#    row says so; a stall on cuLaunchKernel fires;
# 2. the node agent on a Unix socket, a local controller arming the same
#    stall through it (fires streamed back), then the controller SIGKILLed:
#    the lease's expiry and the last fire measured from the evidence;
# 3. evidence merge of the two databases into one, `show` on the merged.
# Writes $OUT/fleet.json.
set -uo pipefail
source "$(dirname "$0")/checkout_env.sh" || exit 2
W=/root/gf-fleet
mkdir -p $W && chmod 700 $W && rm -rf $W/*
python3 - "$LIBCUDA" "$W" "$OUT/fleet.json" <<'PY'
import json, os, re, signal, sqlite3, subprocess, sys, threading, time, urllib.request
libcuda, w, out = sys.argv[1:]
GF = [sys.executable, "-m", "pyctl"]
res = {"libcuda": libcuda}

svc = subprocess.Popen([sys.executable, "-m", "pyctl.service", "--port", "0", "--device", os.environ.get("GF_DEVICE", "cuda"),
                        "--batch-wait", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True)
url = None
for line in svc.stderr:
    m = re.search(r"serving on (https?://\S+)", line)
    if m:
        url = m.group(1)
        break
threading.Thread(target=lambda: [None for _ in svc.stderr], daemon=True).start()
res["service"] = {"pid": svc.pid, "url": url}
stop = threading.Event()
sent = [0, 0]

def load():
    body = json.dumps({"prompt": "hello world", "max_tokens": 4}).encode()
    while not stop.is_set():
        try:
            req = urllib.request.Request(url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=10).read()
            sent[0] += 1
        except Exception:
            sent[1] += 1

threading.Thread(target=load, daemon=True).start()
time.sleep(3)  # warm: the service's first requests load cuBLAS and the kernels

def rows(db, sql, *a):
    c = sqlite3.connect(db)
    try:
        return c.execute(sql, a).fetchall()
    finally:
        c.close()

# 1. selectors: --ranks-of and --comm resolve to the service.
sel = {}
for name, args in (("ranks-of", ["--ranks-of", str(svc.pid)]),
                   ("comm", ["--comm", open(f"/proc/{svc.pid}/comm").read().strip()])):
    db = f"{w}/sel-{name}.db"
    t0 = time.time()
    p = subprocess.run([*GF, "inject", *args, "--lib", libcuda, "--fn", "cuLaunchKernel",
                        "--action", "stall", "--stall", "1ms", "--prob", "1%", "--max", "20",
                        "--duration", "4s", "-q", "--db", db], capture_output=True, text=True,
                       timeout=120)
    sel[name] = {"rc": p.returncode, "err": p.stderr[-500:], "s": round(time.time() - t0, 2),
                 "targets": rows(db, "SELECT host_pid, ns_pid, rank, selector, comm FROM targets")
                 if os.path.exists(db) else None,
                 "fires": rows(db, "SELECT count(*) FROM faults")[0][0] if os.path.exists(db) else None}
    print("selector", name, sel[name], flush=True)
res["selectors"] = sel

# 2. the agent, a controller through it, the controller SIGKILLed.
adb = f"{w}/agent.db"
agent = subprocess.Popen([*GF, "agent", "serve", "--listen", f"unix:{w}/run/agent.sock",
                          "--db", adb], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
aurl = None
for line in agent.stderr:
    if "agent: listening on " in line:
        aurl = line.split("listening on ")[1].split(" (pid")[0].split()[0]
        break
threading.Thread(target=lambda: [None for _ in agent.stderr], daemon=True).start()
code = f"""
import sys, time
sys.path.insert(0, {os.getcwd()!r})
import gpufault
c = gpufault.AgentClient.connect({aurl!r})
t0 = time.perf_counter()
h = c.arm(gpufault.Fault.stall({libcuda!r}, "cuLaunchKernel", stall="1ms", prob="2%"),
          {svc.pid}, lease_s=1.0, duration=60)
print("armed", h.run_id, round(time.perf_counter() - t0, 3), flush=True)
h.wait_fires(5, timeout=20)
print("fires", h.counters.fires, flush=True)
sys.stdin.read()
"""
ctl = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
armed = ctl.stdout.readline().split()
streamed = ctl.stdout.readline().split()
killed = time.time()
ctl.kill(); ctl.wait()
run_id = armed[1] if len(armed) > 1 else ""
deadline = time.time() + 15
status, stats = None, {}
while time.time() < deadline:
    r = rows(adb, "SELECT status, stats FROM runs WHERE run_id = ?", run_id)
    # The child marks its run done; the agent adds why it ended just after.
    if r and r[0][0] == "done" and "agent" in json.loads(r[0][1] or "{}"):
        status, stats = r[0][0], json.loads(r[0][1] or "{}")
        break
    time.sleep(0.1)
walls = [x[0] for x in rows(adb, "SELECT wall FROM faults WHERE run_id = ? ORDER BY wall", run_id)]
ag = stats.get("agent", {})
res["agent"] = {"url": aurl, "armed": armed, "streamed": streamed, "status": status,
                "agent_stats": ag, "fires": len(walls),
                "kill_to_expiry_s": round(ag["lease_expired_at"] - killed, 3) if "lease_expired_at" in ag else None,
                "kill_to_last_fire_s": round(walls[-1] - killed, 3) if walls else None,
                "ctl_err": ctl.stderr.read()[-500:]}
print("agent", res["agent"], flush=True)
st = subprocess.run([*GF, "agent", "status", "--agent", aurl], capture_output=True, text=True)
res["agent"]["status_after"] = st.stdout[-400:]
agent.terminate(); agent.wait(30)

# 3. one store from both.
m = subprocess.run([*GF, "evidence", "merge", f"{w}/sel-ranks-of.db", adb, "--into",
                    f"{w}/fleet.db"], capture_output=True, text=True)
res["merge"] = {"rc": m.returncode, "out": m.stdout, "err": m.stderr[-300:]}
sh = subprocess.run([*GF, "show", "latest", "--db", f"{w}/fleet.db"], capture_output=True, text=True)
res["merge"]["show_head"] = sh.stdout.splitlines()[:8]
stop.set()
svc.send_signal(signal.SIGTERM); svc.wait(30)
res["load"] = {"ok": sent[0], "errors": sent[1], "service_rc": svc.returncode}
json.dump(res, open(out, "w"), indent=2)
print(json.dumps(res, indent=2))
PY
