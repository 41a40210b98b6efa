#!/usr/bin/env bash
# Issue 26, "the 4-13 ms hold", on the GPU machine: bench/bench_copilot.py
# --shape server (a CPython target with threads in poll/recv/accept, a
# thread taking the GIL, a ctypes worker calling cuMemAlloc_v2) through the
# whole engine, signal path and copilot in each round, on the REAL libcuda,
# with torch imported in the target; this checkout's pyctl, then the one
# before the fix (build/h200old/pyctl, the commit before it with its build
# outputs), same bench, same machine, interleaved.
# Writes $OUT/server-*.json and their logs.
set -uo pipefail
source "$(dirname "$0")/checkout_env.sh" || exit 2
NEW=$PWD
OLD=$PWD/build/h200old
for round in 1; do
    for which in new old; do
        root=$NEW; [ $which = old ] && root=$OLD
        PYTHONPATH=$root python3 bench/bench_copilot.py --shape server --torch --lib "$LIBCUDA" \
            --calls 2000 --rounds 2 > $OUT/server-$which-torch-$round.json \
            2> $OUT/server-$which-torch-$round.log; echo "$which torch $round rc=$?"
    done
done
[ "${GF_NOWORK:-1}" = 1 ] && for which in new old; do
    root=$NEW; [ $which = old ] && root=$OLD
    PYTHONPATH=$root python3 bench/bench_copilot.py --shape server --no-python-work \
        --lib "$LIBCUDA" --calls 2000 --rounds 2 > $OUT/server-$which-nowork.json \
        2> $OUT/server-$which-nowork.log; echo "$which nowork rc=$?"
done
nproc; cat /proc/loadavg
