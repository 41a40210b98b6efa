#!/bin/bash
# Install what gpufault needs to build and test on a fresh Debian 12 host.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
# libc6-dbg: libc's local functions (start_thread) for the symbolizer's
# known-answer tests, as a forensics user would install it. linux-perf:
# perf record --call-graph dwarf, the peer tests/test_unwind.py checks
# gpufault's unwound frames against.
APT_PKGS=(clang llvm libbpf-dev libbpf1 bpftool libelf-dev zlib1g-dev make gcc gcc-12 g++ libc6-dbg gdb
	binutils qemu-system-x86 busybox-static cpio xz-utils zstd kmod sqlite3 strace
	util-linux iproute2 dwarves sparse bpftrace linux-perf
	prometheus chromium crun libfiu-dev)
missing=()
for p in "${APT_PKGS[@]}"; do
	dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
	apt-get update -qq
	apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# prometheus: the observability tests start their own server; the Debian
# units (started by the packages where init allows; node-exporter comes as
# a recommendation) must not run beside them.
for unit in prometheus prometheus-node-exporter; do
	if command -v systemctl >/dev/null && systemctl is-enabled "$unit" >/dev/null 2>&1; then
		systemctl disable --now "$unit" >/dev/null 2>&1 || true
	fi
done
# The CPU build of torch for the Tensor-Core perturbation hook's tests (a
# local file on these machines; pip takes it from there), installed before
# the dev extra: its transformers[serving] asks for torch>=2.6, which pip
# would otherwise meet with the newest CUDA build. That build loads the real
# libcublas.so.13 into the reference service beside the libcublas TEST
# DOUBLE of the same name, and the cuBLAS-class tests then probe the real
# one, which the CPU service never calls (seen on a fresh machine).
python3 -c 'import torch' 2>/dev/null || python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[dev]'
