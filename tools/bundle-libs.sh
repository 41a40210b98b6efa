#!/usr/bin/env bash
# Copy this system's libbpf.so.1 and the libelf.so.1 it links into DEST
# (default pyctl/data/lib, git-ignored): the wheel carries them for hosts
# without libbpf (pyctl/bpf/libbpf.py uses them only when the dynamic loader
# finds no libbpf.so.1). One copy step, used by `make build`.
#   tools/bundle-libs.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-pyctl/data/lib}
mkdir -p "$DEST"
for so in libbpf.so.1 libelf.so.1; do
    # awk reads to the end: an early exit killed ldconfig with SIGPIPE on a
    # host whose cache is longer than a pipe's buffer, and pipefail made the
    # lookup fail (make: Error 141 on a clean CI machine).
    src=$(ldconfig -p | awk -v n="$so" '$1 == n && /x86-64/ && !src {src = $NF} END {print src}')
    [ -n "$src" ] || { echo "bundle-libs: $so not found: apt-get install libbpf1 libelf1" >&2; exit 2; }
    cp -fL "$src" "$DEST/$so.tmp" && mv -f "$DEST/$so.tmp" "$DEST/$so"
done
