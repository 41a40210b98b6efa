#!/usr/bin/env bash
# Issue 24 on the GPU machine: gpufault explore against the reference
# service on CUDA (real libcuda 580 and cuBLAS 13 under torch): discover,
# plan (no hangs, at most 6 trials), run, report. Writes $OUT/explore.json
# (the report's JSON), $OUT/explore.md and the run's output.
set -uo pipefail
source "$(dirname "$0")/checkout_env.sh" || exit 2
W=/root/gf-explore
mkdir -p $W && chmod 700 $W && rm -rf $W/*
cat > $W/svc.toml <<'TOML'
name = "svc-cuda"
version = 1
title = "The reference service on CUDA under explore"
slo_id = "completions-p99"
[target]
service = { device = "cuda", args = ["--batch-wait", "0", "--breaker-errors", "3", "--breaker-cooldown", "500ms"] }
[load]
rate = 20.0
prompt = "hello world"
max_tokens = 4
timeout = "2s"
[phases]
warmup = "3s"
baseline = "4s"
[steady_state]
p99 = "<= 500ms"
error_rate = "<= 1%"
quorum = "60%"
TOML
python3 -m pyctl explore run $W/svc.toml --lib libcuda --lib libcublas --no-hang --max-runs 6 \
    --db $W/svc.db > $OUT/explore-run.txt 2>&1; echo "run rc=$?"
ID=$(grep -o "exploration [0-9a-f]*" $OUT/explore-run.txt | head -1 | cut -d' ' -f2)
python3 -m pyctl explore report $ID --db $W/svc.db > $OUT/explore.md 2>&1; echo "report rc=$?"
python3 -m pyctl explore report $ID --db $W/svc.db --json > $OUT/explore.json 2>&1
cp $W/svc.db $OUT/ 2>/dev/null
