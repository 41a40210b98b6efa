#!/bin/bash
# Install what gpufault needs to build and test on a fresh Debian 12 host.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
APT_PKGS=(clang llvm libbpf-dev libbpf1 bpftool libelf-dev zlib1g-dev make gcc
	qemu-system-x86 busybox-static cpio xz-utils zstd kmod sqlite3)
missing=()
for p in "${APT_PKGS[@]}"; do
	dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
	apt-get update -qq
	apt-get install -y -qq "${missing[@]}" >/dev/null
fi
python3 -m pip install -q -e '.[dev]'
