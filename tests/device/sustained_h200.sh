#!/bin/bash
# Sustained ingest on the H200 host (docs/benchmarks.md "Sustained ingest"):
# the store's side alone (bench_sustained.py --insert), then 300k calls/s
# traced for SECONDS (default 60), each with the multi-row calls insert (48)
# and the one-record insert of before (1), the store on the disk (/tmp) and
# in /dev/shm (KS="48" for the multi-row insert alone). Writes $OUT/ins-K-DIR.json and $OUT/s-K-DIR.json.
set -uo pipefail
source "$(dirname "$0")/checkout_env.sh" || exit 2
SECONDS_RUN=${1:-60}
DIRS=${DIRS:-/tmp /dev/shm}
S='import json,sys;r=json.load(open(sys.argv[1]))["run"];print({k:r[k] for k in ("events_stored","rows_in_store","events_lost","stored_per_s_median","drain_tail_s","store_mib")}, [p["stored_per_s"]//1000 for p in r["per_second"]])'
nproc; python3 --version; python3 -c "import sqlite3;print(sqlite3.sqlite_version)"; uname -r
for dir in $DIRS; do
    for k in ${KS:-48 1}; do
        tag=$k-$(basename $dir)
        GF_BENCH_DB_DIR=$dir GPUFAULT_CALL_ROWS_PER_INSERT=$k python3 bench/bench_sustained.py \
            --insert 2000000 > $OUT/ins-$tag.json; cat $OUT/ins-$tag.json
        GF_BENCH_DB_DIR=$dir GPUFAULT_CALL_ROWS_PER_INSERT=$k timeout 280 python3 \
            bench/bench_sustained.py 300000 $SECONDS_RUN > $OUT/s-$tag.json 2>>$OUT/err.log
        echo "dir=$dir k=$k rc=$?"; python3 -c "$S" $OUT/s-$tag.json
    done
done
# Where the consumer's time goes there: one short run under cProfile.
timeout 200 python3 -m cProfile -s tottime bench/bench_sustained.py 300000 15 2>&1 \
    | grep -A14 "Ordered by" | cut -c1-120
