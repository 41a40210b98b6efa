#!/usr/bin/env bash
# Issue 22 on the GPU machine: the Python frames of a torch process at an
# injected CUDA_ERROR_OUT_OF_MEMORY (the 4th cuMemAlloc_v2, sticky), read
# from the interpreter (pyctl/symbols/pystack.py: the host's CPython 3.12)
# and joined to the native stack under its eval-loop frames. Writes
# $OUT/pyframes_torch.txt (show) and $OUT/pyframes_torch.json.
set -uo pipefail
source "$(dirname "$0")/checkout_env.sh" || exit 2
cat > /tmp/gf-torch-model.py <<'PY'
import torch
class Block(torch.nn.Module):
    def forward(self, x):
        return self.grow(x)
    def grow(self, x):
        return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
    def forward(self, x):
        return self.block(x)
torch.cuda.init()
m = Model()
keep = []
def serve(n):
    for i in range(n):
        keep.append(m(i))
        print("allocated", i, flush=True)
try:
    serve(8)
except torch.OutOfMemoryError as e:
    print("OOM:", str(e).splitlines()[0], flush=True)
PY
DB=/root/gf-pyframes/p.db
mkdir -p /root/gf-pyframes && chmod 700 /root/gf-pyframes && rm -f "$DB"*
python3 -m pyctl inject --lib "$LIBCUDA" --fn cuMemAlloc_v2 --action fail \
    --ret CUDA_ERROR_OUT_OF_MEMORY --after 3 --sticky --db "$DB" -- python3 /tmp/gf-torch-model.py 2>&1 | tail -12
python3 - "$DB" "$OUT" <<'PY'
import json, sys
from pyctl.evidence import query, store
db, out = sys.argv[1], sys.argv[2]
conn = store.open_db(db, readonly=True)
(fid,) = conn.execute("SELECT fault_id FROM faults ORDER BY seq LIMIT 1").fetchone()
doc = query.fault_chain(conn, fid)
text = query.render_chain(doc)
res = {"fault": fid, "mechanism": doc["fault"]["mechanism"],
       "python": doc["fault"]["outcome"].get("python") if doc["fault"]["outcome"] else None,
       "pyframes": doc["pyframes"], "native": len(doc["stack"])}
open(f"{out}/pyframes_torch.txt", "w").write(text + "\n")
json.dump(res, open(f"{out}/pyframes_torch.json", "w"), indent=1, default=str)
print(text)
PY
