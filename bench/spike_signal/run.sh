#!/bin/bash
# Spike driver: run.sh MODE THREADS N [probe|none]
set -e
D=$(dirname "$0"); B=${SPIKE_BUILD:-/tmp/spike}
mkdir -p $B
clang -g -O2 -target bpf -mcpu=v3 -D__TARGET_ARCH_x86 -Wall -idirafter /usr/include/x86_64-linux-gnu -c $D/spike.bpf.c -o $B/spike.bpf.o
gcc -O2 -Wall -Wno-discarded-qualifiers -o $B/loader $D/loader.c -lbpf
gcc -O2 -g -fcf-protection=none -Wall -o $B/target $D/target.c -lpthread
MODE=$1 NT=$2 N=$3 PROBE=${4:-probe}
coproc T { $B/target $MODE $NT $N; }
read -u ${T[0]} ready pid
OFF=0x$(nm $B/target | awk '/ gf_spike_victim$/{print $1}')
if [ "$PROBE" = probe ]; then
  exec 5> >(true)
  coproc L { $B/loader $B/spike.bpf.o spike_$MODE $pid $B/target $OFF; }
  read -u ${L[0]} st; [ "$st" = attached ] || { echo "loader: $st"; kill $pid; exit 1; }
fi
echo go >&${T[1]}
read -u ${T[0]} res; echo "mode=$MODE threads=$NT probe=$PROBE $res"
if [ "$PROBE" = probe ]; then exec {L[1]}>&-; read -u ${L[0]} f; echo "bpf $f"; fi
