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
B=.device
ls "$B"/whl/gpufault-*.whl >/dev/null 2>&1 \
    || { echo "run.sh: no gpufault wheel in $B/whl: run make device-bundle here and carry .device"; exit 2; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# --target, not a venv: the image's python3 is itself a venv (torch), which a
# nested venv would not see. --no-deps: the image has click and the rest.
rm -rf /tmp/gf-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/gf-site "$B"/whl/*.whl || { echo "run.sh: wheel install failed"; exit 2; }
# The wheel's pyctl first; the checkout only for tests.device; PYTHONSAFEPATH
# (3.11+): `python -m` and scripts never prepend the cwd (this checkout's pyctl).
export PYTHONPATH=/tmp/gf-site:$PWD PYTHONSAFEPATH=1 PATH=/tmp/gf-site/bin:$PATH
python3 -c 'import sys, pyctl; sys.exit(not pyctl.__file__.startswith("/tmp/gf-site/"))' \
    || { echo "run.sh: pyctl is not imported from the wheel"; exit 2; }
# crt/mma.h for pyctl/hooks/wmma_flip.py's WMMA back end (its PTX back end needs none).
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
# No tracefs mount here: the engine and the Xid monitor need none, and a
# mount made by the harness once hid that they did.
echo "== $(date -u) $(uname -r) $(python3 -V 2>&1) $(ls "$B"/whl/gpufault-*.whl)"
gpufault doctor || true
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -m tests.device.checks --out "$OUT" --only "${1:-single}" --timeout "${2:-240}"
rc=$?
echo "== done rc=$rc $(date -u)"
exit $rc
