#!/usr/bin/env bash
# Issue 23 on the GPU machine, second call (after issue23_h200.sh found that
# the streaming files stall cuCtxSynchronize, which torch does not call, and
# that root there lacks CAP_SYS_NICE): the streaming experiments on CUDA with
# fn=cuStreamSynchronize; the arrival bench with every core busy (the
# default there is the 0.1 ms slice; "slice" and normal threads beside it);
# the streamed TTFT/ITL bench; sustained ingest in /dev/shm (build/targets
# carried for the traced target). Carry .device, pyctl/data, build/targets.
# Writes $OUT/issue23b.tar (every JSON) and $OUT/issue23b.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
W=/tmp/gf-23b
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/issue23b.log") 2>&1
nproc; uptime
OUT=$W timeout -k 5 150 tests/device/experiments.sh stream-itl-stall,fn=cuStreamSynchronize \
    stream-slo-burn,fn=cuStreamSynchronize
echo "experiments rc=$?"
(
    source tests/device/checkout_env.sh || exit 2
    GF_BENCH_ROUNDS=3 timeout 150 python3 bench/bench_loadgen_arrival.py --busy 16 \
        > "$W/arrival-h200.json"; echo "arrival rc=$?"
    timeout 90 python3 bench/bench_loadgen_stream.py > "$W/stream-h200.json"; echo "stream rc=$?"
)
OUT=$W DIRS=/dev/shm timeout 170 tests/device/sustained_h200.sh 20; echo "sustained rc=$?"
rm -f "$W"/h200.db "$W"/report.html
tar -C "$W" -cf "$OUT/issue23b.tar" .
ls -la "$W"
