#!/usr/bin/env bash
# Prepare .device/ (git-ignored) for the GPU machine, which has no clang, no
# libbpf and no package registry: the gpufault wheel built here (it carries
# the BPF objects, Debian's libbpf.so.1 + libelf, the LD_PRELOAD shim and
# the libcuda test double with its gf-infer workload, whose PTX kernels also
# run on a real GPU), and cp312 wheels of the Python dependencies its image
# lacks, all in .device/whl. Carry it as `.device`; tests/device/run.sh
# installs them. Idempotent: dependency wheels already present are not
# fetched again; the gpufault wheel is built afresh.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.device
# Pinned so the bundle is the same every time; the image already has click,
# pluggy, python-dateutil, tabulate and six (see KINDS.md's package list).
WHEELS=(pyelftools==0.33 pyroute2==0.9.7 rust-demangler==1.0)

PYTHON=${PYTHON:-python3}

for f in pyctl/data/gpufault.bpf.o pyctl/data/doubles/gf-infer pyctl/data/preload/gfpreload.so \
         pyctl/data/lib/libbpf.so.1; do
    [ -e "$f" ] || { echo "device-bundle: $f missing: run make build first" >&2; exit 2; }
done
# Loose objects of older bundles: run.sh installs the wheel instead.
rm -rf "$OUT/bpf" "$OUT/lib" "$OUT/bin"
mkdir -p "$OUT/whl"
rm -f "$OUT"/whl/gpufault-*.whl
"$PYTHON" -m build --wheel --outdir "$OUT/whl" . >"$OUT/build.log" 2>&1 \
    || { tail -20 "$OUT/build.log" >&2; echo "device-bundle: wheel build failed ($OUT/build.log)" >&2; exit 2; }
ls "$OUT"/whl/gpufault-*-py3-none-linux_x86_64.whl
for w in "${WHEELS[@]}"; do
    name=${w%%==*}
    stem=$(echo "$name" | tr '-' '_')
    if ! ls "$OUT/whl/" 2>/dev/null | grep -qi "^${stem}-${w##*==}-"; then
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux2014_x86_64 --platform any \
            -d "$OUT/whl" "$w"
    fi
done
# The toolkit's crt/mma.h for the WMMA hook (the CUDA 13 runtime wheels lack
# it). Kept out of whl/: run.sh extracts only include/crt from it, so no
# second `nvidia` package shadows the image's.
mkdir -p "$OUT/extra"
ls "$OUT/extra/" | grep -q '^nvidia_cuda_crt-' || python3 -m pip download -q --no-deps \
    --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
    -d "$OUT/extra" nvidia-cuda-crt
du -sh "$OUT" | awk '{print "device-bundle: " $1 " in " $2}'
