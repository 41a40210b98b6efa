#!/usr/bin/env bash
# Device checks on the GPU machine: run from the repository root with the
# bundle carried (`make device-bundle`, carry .device). Installs nothing
# system-wide: the gpufault wheel (BPF objects, bundled libbpf/libelf, the
# shim and the libcuda test double inside) and the dependency wheels the
# image lacks go to /tmp/gf-site, and that pyctl is the one imported: this
# checkout's pyctl/ has sources only (its build outputs are not carried).
# Writes $OUT/results.json, $OUT/device.log and the captured Xid format file.
#   tests/device/run.sh [single|nccl|check,check,...] [per-check timeout s]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
LOG="$OUT/device.log"
exec > >(tee -a "$LOG") 2>&1
source tests/device/setup.sh || exit 2
echo "== $(date -u) $(uname -r) $(python3 -V 2>&1) $(ls "$B"/whl/gpufault-*.whl)"
gpufault doctor || true
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -m tests.device.checks --out "$OUT" --only "${1:-single}" --timeout "${2:-240}"
rc=$?
echo "== done rc=$rc $(date -u)"
exit $rc
