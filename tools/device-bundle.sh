#!/usr/bin/env bash
# Prepare .device/ (git-ignored) for the GPU machine, which has no clang, no
# libbpf and no package registry: the BPF objects built here, Debian's
# libbpf.so.1 (+ libelf it links), the CPU-double workload gf-infer (its PTX
# kernels also run on a real GPU), and cp312 wheels of the Python
# dependencies its image lacks. Carry it as `.device`; tests/device/run.sh
# uses it. Idempotent: wheels already present are not fetched again.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.device
# Pinned so the bundle is the same every time; the image already has click,
# pluggy, python-dateutil, tabulate and six (see KINDS.md's package list).
WHEELS=(sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click-default-group==1.2.4
        pyelftools==0.33 pyroute2==0.9.7)

objs=(pyctl/data/*.bpf.o)
[ -e "${objs[0]}" ] || { echo "device-bundle: no BPF objects: run make build first" >&2; exit 2; }
[ -x build/doubles/gf-infer ] || { echo "device-bundle: build/doubles/gf-infer missing: run make build" >&2; exit 2; }
mkdir -p "$OUT/bpf" "$OUT/lib" "$OUT/bin" "$OUT/whl"
cp -f pyctl/data/*.bpf.o "$OUT/bpf/"
for so in libbpf.so.1 libelf.so.1; do
    src=$(ldconfig -p | awk -v n="$so" '$1 == n && /x86-64/ {print $NF; exit}')
    [ -n "$src" ] || { echo "device-bundle: $so not found: apt-get install libbpf1 libelf1" >&2; exit 2; }
    cp -fL "$src" "$OUT/lib/$so"
done
cp -f build/doubles/gf-infer "$OUT/bin/"
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
