#!/usr/bin/env bash
# Issue 23 (and 26's sustained ingest) on the GPU machine, one call:
# 1. experiments on CUDA through the wheel (tests/device/experiments.sh):
#    quality-bleu-bitflip (and with bits=mant:0, the pass), stream-itl-stall,
#    stream-slo-burn: BLEU-4, TTFT and ITL of the reference service on the H200;
# 2. the load generator's benches from this checkout: arrivals with the
#    real-time load threads against normal ones, every core busy (--busy 16),
#    and the streamed TTFT/ITL accuracy;
# 3. sustained ingest in /dev/shm, 48 and 1 rows a statement (sustained_h200.sh).
# Carry .device (make device-bundle) and pyctl/data (make build).
# Writes $OUT/experiments.jsonl, report.md, arrival-h200.json, stream-h200.json,
# ins-*.json and s-*.json (sustained), and issue23.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/issue23.log") 2>&1
nproc; uptime
timeout -k 5 250 tests/device/experiments.sh quality-bleu-bitflip quality-bleu-bitflip,bits=mant:0 \
    stream-itl-stall stream-slo-burn
echo "experiments rc=$?"
(
    source tests/device/checkout_env.sh || exit 2
    GF_BENCH_ROUNDS=3 timeout 120 python3 bench/bench_loadgen_arrival.py --busy 16 \
        > "$OUT/arrival-h200.json"; echo "arrival rc=$?"
    timeout 90 python3 bench/bench_loadgen_stream.py > "$OUT/stream-h200.json"; echo "stream rc=$?"
)
DIRS=/dev/shm timeout 150 tests/device/sustained_h200.sh 20; echo "sustained rc=$?"
rm -f "$OUT"/h200.db "$OUT"/report.html "$OUT"/experiments.log
ls -la "$OUT"
