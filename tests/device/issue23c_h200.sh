#!/usr/bin/env bash
# Third call: the streaming experiments on CUDA with fn=cuStreamSynchronize
# (the wheel rebuilt with that knob), then sustained ingest at 300k calls/s
# for 60 s with the multi-row insert, the store on the disk (/tmp) and in
# /dev/shm. Carry .device, pyctl/data, build/targets.
# Writes $OUT/issue23c.tar and $OUT/issue23c.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
W=/tmp/gf-23c
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/issue23c.log") 2>&1
nproc; uptime
OUT=$W timeout -k 5 150 tests/device/experiments.sh stream-itl-stall,fn=cuStreamSynchronize \
    stream-slo-burn,fn=cuStreamSynchronize
echo "experiments rc=$?"
OUT=$W KS=48 timeout 330 tests/device/sustained_h200.sh 60; echo "sustained rc=$?"
rm -f "$W"/h200.db "$W"/report.html
tar -C "$W" -cf "$OUT/issue23c.tar" .
ls -la "$W"
