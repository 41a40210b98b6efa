#!/usr/bin/env bash
# Issue 22 on the GPU machine: a torch process whose 4th cuMemAlloc_v2 gets
# an injected SIGABRT (it dies ~ms later), unwound from the stack copy by
# CFI (torch's and libcuda's libraries have no frame pointers), named from
# the mappings followed from attach on. Runs the checkout's pyctl with its
# build outputs carried (pyctl/data: BPF objects, libbpf). Writes
# $OUT/unwind_torch.txt (show's stack) and $OUT/unwind_torch.json.
set -uo pipefail
source "$(dirname "$0")/checkout_env.sh" || exit 2
echo "libcuda: $LIBCUDA"
cat > /tmp/gf-torch-alloc.py <<'PY'
import torch
torch.cuda.init()
keep = []
for i in range(8):
    keep.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    print("allocated", i, flush=True)
PY
DB=/root/gf-unwind/u.db
mkdir -p /root/gf-unwind && chmod 700 /root/gf-unwind && rm -f "$DB"*
python3 -m pyctl inject --lib "$LIBCUDA" --fn cuMemAlloc_v2 --action signal --signal SIGABRT \
    --after 3 --max 1 --db "$DB" -- python3 /tmp/gf-torch-alloc.py 2>&1 | tail -8
python3 - "$DB" "$OUT" <<'PY'
import json, sys, time
from pyctl.evidence import query, store
db, out = sys.argv[1], sys.argv[2]
conn = store.open_db(db, readonly=True)
(fid,) = conn.execute("SELECT fault_id FROM faults").fetchone()
t0 = time.monotonic()
doc = query.fault_chain(conn, fid)
text = query.render_chain(doc)
rows = conn.execute("SELECT depth, symbol, module, method, build_id, stop FROM stacks "
                    "WHERE fault_id=? ORDER BY depth", (fid,)).fetchall()
res = {"show_s": round(time.monotonic() - t0, 2), "frames": len(rows),
       "methods": [r[3] for r in rows], "unnamed": [r[1] for r in rows if r[1].startswith("0x")],
       "no_module": [r[0] for r in rows if not r[2]], "stop": rows[-1][5] if rows else None,
       "stored": rows}
open(f"{out}/unwind_torch.txt", "w").write(text + "\n")
json.dump(res, open(f"{out}/unwind_torch.json", "w"), indent=1, default=str)
print(text)
print(json.dumps({k: v for k, v in res.items() if k != "stored"}))
PY
