#!/usr/bin/env bash
# Experiments on the GPU machine against real CUDA: run from the repository
# root with the bundle carried (`make device-bundle`, carry .device).
#   tests/device/experiments.sh [NAME[,KNOB=VALUE...] ...]
# Default: every experiment with a GPU form. Each runs with
# --set device=cuda where it has that knob, into one database
# (/tmp/gf-device/h200.db, copied to $OUT at the end); then one report
# (HTML + Markdown) of all of them. $OUT: experiments.jsonl (one --json
# result a line), experiments.log, report.html, report.md, h200.db.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT" /tmp/gf-device
exec > >(tee -a "$OUT/experiments.log") 2>&1
source tests/device/setup.sh || exit 2
DB=/tmp/gf-device/h200.db
echo "== $(date -u) $(uname -r) $(python3 -V 2>&1) $(ls "$B"/whl/gpufault-*.whl)"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
list=("$@")
# cuda-stream-stall-p99 on cuStreamSynchronize: torch's per-token read-back
# syncs the stream (the double path calls cuCtxSynchronize). The cublasLt
# run shows torch absorbing failed cublasLtMatmul calls (no error reaches
# the service). cuda-corrupt-xid-linked last: it ends its service's context.
[ ${#list[@]} -gt 0 ] || list=(cuda-oom-degrade cuda-launch-failed-degrade
    cuda-ctx-destroyed-degrade cuda-stream-stall-p99,fn=cuStreamSynchronize
    cuda-oom-leak-held cuda-vram-pressure-degrade cuda-graph-replay-degrade cublas-gemm-fail-degrade
    cublas-gemm-fail-degrade,lib=libcublasLt,fn=cublasLtMatmul,every=97
    tc-bitflip-agreement tokenizer-stall cuda-corrupt-xid-linked)
for entry in "${list[@]}"; do
    IFS=, read -r name rest <<<"$entry"
    sets=()
    gpufault experiment show "$name" 2>/dev/null | grep -q '^ *device\b' && sets+=(--set device=cuda)
    IFS=, read -ra kv <<<"${rest:-}"
    for s in "${kv[@]}"; do [ -n "$s" ] && sets+=(--set "$s"); done
    echo "== experiment $name ${sets[*]} $(date -u +%T)"
    # --json: the narrative on stderr (the log), the result on stdout.
    timeout -k 10 240 gpufault experiment run "$name" "${sets[@]}" --db "$DB" --json \
        >/tmp/gf-device/one.json
    echo "== $name rc=$?"
    grep '^{' /tmp/gf-device/one.json >>"$OUT/experiments.jsonl" \
        || echo "{\"name\": \"$name\", \"no_json\": true}" >>"$OUT/experiments.jsonl"
done
ids=$(gpufault experiment results --db "$DB" | awk '{print $1}' | tac)
echo "== report of: $ids"
# shellcheck disable=SC2086
gpufault experiment report $ids --db "$DB" --title "gpufault experiments on the H200" \
    -o "$OUT/report.html" --markdown "$OUT/report.md"
echo "== report rc=$?"
cp "$DB" "$OUT/h200.db"
echo "== done $(date -u)"
