#!/usr/bin/env bash
# Issue 23's "Any server" on the GPU machine: Hugging Face's `transformers
# serve` (wheels carried in build/h200wheels: the image has transformers,
# not its serving extra) on a tiny random GPT-2 saved here (tests/tiny_hf.py),
# on the GPU, under two experiments gpufault starts it for by --command:
# 1. the shipped tokenizer-stall (HF tokenizers' encode, 300 ms on 20 %);
# 2. a stall of cuLaunchKernel in the real libcuda (an inline file).
# Writes $OUT/third_party.json and each run's --json.
set -uo pipefail
source "$(dirname "$0")/checkout_env.sh" || exit 2
W=/root/gf-3p
mkdir -p $W && chmod 700 $W && rm -rf $W/*
python3 -m pip install -q --no-index --no-deps --break-system-packages build/h200wheels/*.whl \
    > $OUT/pip.log 2>&1 || { tail -20 $OUT/pip.log; exit 3; }
export HF_HUB_OFFLINE=1
python3 - "$W" "$OUT" "$LIBCUDA" <<'PY'
import json, shlex, subprocess, sys, time
sys.path.insert(0, "tests")
import tiny_hf
w, out, libcuda = sys.argv[1:]
import transformers
model = tiny_hf.build(__import__("pathlib").Path(w) / "tiny")
serve = shlex.join([*tiny_hf.SERVE, str(model), "--port", "0", "--host", "127.0.0.1"])
res = {"transformers": transformers.__version__, "libcuda": libcuda}
inline = f'''
name = "tf-serve-launch-stall"
version = 1
title = "transformers serve on the GPU: 20 ms stalls in cuLaunchKernel on 2 % of launches"
slo_id = "completions-p99"
[target]
command = ["placeholder"]
[load]
rate = 10.0
prompt = "hello world"
max_tokens = 8
timeout = "5s"
[phases]
warmup = "3s"
baseline = "8s"
recovery = "6s"
[steady_state]
p99 = "<= 2s"
error_rate = "<= 1%"
quorum = "60%"
judge = {{ alpha = 0.01, min_effect = 0.1 }}
[[method]]
name = "stall cuLaunchKernel"
fault = {{ lib = "{libcuda}", fn = "cuLaunchKernel", action = "stall", stall = "20ms", prob = "2%" }}
start = "0s"
duration = "8s"
[expect]
verdict = "fail"
'''
f = f"{w}/tf-serve-launch-stall.toml"
open(f, "w").write(inline)
for name, target, sets in (
    ("tokenizer-stall", "tokenizer-stall", ["p99=400ms", "stall=300ms", "rate=10"]),
    ("launch-stall", f, []),
):
    t0 = time.time()
    argv = [sys.executable, "-m", "pyctl", "experiment", "run", target, "--command", serve,
            "--ready", tiny_hf.READY, "--db", f"{w}/{name}.db", "--json"]
    for s in sets:
        argv += ["--set", s]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=400)
    open(f"{out}/{name}.out", "w").write(p.stdout + "\n---\n" + p.stderr)
    try:
        doc = json.loads(p.stdout.strip().splitlines()[-1])
    except Exception:
        doc = None
    r = subprocess.run([sys.executable, "-m", "pyctl", "experiment", "results",
                        (doc or {}).get("experiment_id") or "", "--db", f"{w}/{name}.db"],
                       capture_output=True, text=True, timeout=60)
    res[name] = {"rc": p.returncode, "s": round(time.time() - t0, 1), "json": doc,
                 "stderr_tail": p.stderr[-1500:], "results": r.stdout[-6000:]}
    print(name, p.returncode, (doc or {}).get("verdict"), flush=True)
json.dump(res, open(f"{out}/third_party.json", "w"), indent=2)
PY
