#!/usr/bin/env bash
# Device checks on the GPU machine: run from the repository root with the
# bundle carried (`make device-bundle`, carry .device). Installs nothing
# system-wide: wheels go to /tmp/gf-site, the bundle's BPF objects and
# libbpf into pyctl/data of this copy. Writes $OUT/results.json,
# $OUT/device.log and the captured Xid format file.
#   tests/device/run.sh [single|nccl|check,check,...] [per-check timeout s]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
LOG="$OUT/device.log"
exec > >(tee -a "$LOG") 2>&1
B=.device
[ -d "$B/bpf" ] || { echo "run.sh: $B missing: run make device-bundle here and carry .device"; exit 2; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gf-site "$B"/whl/*.whl || { echo "run.sh: wheel install failed"; exit 2; }
export PYTHONPATH=/tmp/gf-site:$PWD
cp -f "$B"/bpf/*.bpf.o pyctl/data/ 2>/dev/null || { mkdir -p pyctl/data && cp -f "$B"/bpf/*.bpf.o pyctl/data/; }
cp -f "$B/lib/libbpf.so.1" pyctl/data/libbpf.so.1
# libbpf needs libelf; the image may lack it: use the bundled one then.
if ! ldconfig -p | grep -q 'libelf.so.1 '; then
    mkdir -p /tmp/gf-lib && cp -f "$B/lib/libelf.so.1" /tmp/gf-lib/
    export LD_LIBRARY_PATH=/tmp/gf-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# crt/mma.h for hooks/wmma_flip.py's WMMA back end (its PTX back end needs none).
crt=$(ls "$B"/extra/nvidia_cuda_crt-*.whl 2>/dev/null | head -1)
if [ -n "$crt" ]; then
    python3 - "$crt" <<'PY' && export GF_CUDA_INCLUDE=/tmp/gf-crt/include
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        if "/include/crt/" in info.filename:
            info.filename = "include/crt/" + info.filename.split("/include/crt/", 1)[1]
            z.extract(info, "/tmp/gf-crt")
PY
fi
[ -d /sys/kernel/tracing/events ] || mount -t tracefs nodev /sys/kernel/tracing || echo "run.sh: cannot mount tracefs"
echo "== $(date -u) $(uname -r) $(python3 -V 2>&1)"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -m tests.device.checks --out "$OUT" --only "${1:-single}" --timeout "${2:-240}"
rc=$?
echo "== done rc=$rc $(date -u)"
exit $rc
