#!/bin/sh
# What a newcomer runs first, on a machine with nothing mounted but proc,
# sys and dev: gpufault's own checks, the demo, and a trace of a real
# library (zlib's crc32 called 100 times from Python). Run by
# tests/test_fresh_machine.py inside a private mount namespace on the host
# (tracefs and debugfs unmounted there) and in a VM booted bare. Prints
# FRESH-OK at the end; any step failing stops it with its status.
set -eu
# A directory of root's alone (mktemp -d: 0700): gpufault refuses to write
# a database where other users can create files, as in a sticky /tmp.
dir=$(mktemp -d "${TMPDIR:-/tmp}/gf-fresh-XXXXXX")
db=$dir/gf.db
trap 'rm -rf "$dir"' EXIT
echo "== mounts: $(awk '{print $3}' /proc/self/mounts | sort -u | tr '\n' ' ')"
python3 -m pyctl doctor
python3 -m pyctl demo --db "$db"
python3 -m pyctl trace --lib libz --fn crc32 --db "$db" -- \
    python3 -c 'import zlib; [zlib.crc32(b"x" * i) for i in range(100)]'
n=$(python3 -c 'import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); print(c.execute("select count(*) from calls c join funcs f on c.func = f.func and c.run_id = f.run_id where f.symbol = ?", ("crc32",)).fetchone()[0])' "$db")
echo "crc32 calls recorded: $n"
[ "$n" = 100 ]
# Still nothing mounted that was not there: the engine needed no tracefs.
if grep -qw tracefs /proc/self/mounts; then echo "tracefs got mounted"; exit 3; fi
echo FRESH-OK
