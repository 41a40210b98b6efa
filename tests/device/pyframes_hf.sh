#!/usr/bin/env bash
# Issue 22 on the GPU machine, the issue's own case: an HF transformers
# `generate` loop (a GPT-2 built from a config, random weights, on cuda; no
# download) attached by --pid, every cuMemAlloc_v2 after attach failed with
# CUDA_ERROR_OUT_OF_MEMORY (sticky, via the copilot). The target warms its
# loop at batch 2 and fills torch's small-block pool before it says READY,
# then waits for a line on stdin (sent once the probes are live, read from
# --ready-fd), then runs generate at batch 128/256/512: the first new
# segment torch's caching allocator asks for is one of the model's
# activations (no PYTORCH_NO_CUDA_MEMORY_CACHING: torch's own allocator
# makes the call). Runs the checkout's pyctl with its build outputs carried
# (pyctl/data). Writes $OUT/pyframes_hf.txt (`show latest`),
# $OUT/pyframes_hf.json (`show latest --json`), $OUT/pyframes_hf_check.json.
set -uo pipefail
source "$(dirname "$0")/checkout_env.sh" || exit 2
echo "libcuda: $LIBCUDA $(date -u +%T.%N)"
W=/root/gf-hf
mkdir -p $W && chmod 700 $W && rm -f $W/*
cat > $W/gen.py <<'PY'
import os, sys, time
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
cfg = GPT2Config(n_layer=4, n_embd=768, n_head=12, vocab_size=50257, n_positions=512)
model = GPT2LMHeadModel(cfg).to("cuda").eval()
def gen(ids, mask, new=4):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                              do_sample=False, pad_token_id=0)
for r in range(3):  # the loop before attach: batch 2, its blocks cached afterwards
    w = torch.randint(0, 50257, (2, 16), device="cuda")
    gen(w, torch.ones_like(w))
# Small tensors (generate's bookkeeping) come from cached 2 MiB segments
# after attach; inputs for the rounds after attach exist already.
pad = [torch.empty(512 << 10, dtype=torch.uint8, device="cuda") for _ in range(256)]
del pad
ids = {b: torch.randint(0, 50257, (b, 128), device="cuda") for b in (128, 256, 512)}
masks = {b: torch.ones_like(t) for b, t in ids.items()}
torch.cuda.synchronize()
print(f"READY {os.getpid()} transformers {transformers.__version__} torch {torch.__version__} "
      f"reserved {torch.cuda.memory_reserved() >> 20} MiB", flush=True)
sys.stdin.readline()
for b, t in ids.items():
    t0 = time.monotonic()
    try:
        out = gen(t, masks[b], new=8)
        print(f"round batch {b}: generated {tuple(out.shape)} in {time.monotonic() - t0:.3f} s", flush=True)
    except torch.OutOfMemoryError as e:
        print(f"round batch {b}: OOM after {time.monotonic() - t0:.3f} s: {str(e).splitlines()[0][:160]}", flush=True)
        break
print("target done", flush=True)
PY
DB=$W/hf.db
mkfifo $W/ready $W/tin $W/tout
# fd 5 holds the target's stdin open (read-write: opening never blocks); fd 4
# reads its output until it exits (end of file), READY first.
exec 5<>$W/tin
python3 $W/gen.py <$W/tin >$W/tout 2>&1 &
exec 4<$W/tout
TPID=
while IFS= read -r -t 120 line <&4; do
    echo "target: $line"
    if [[ $line == READY* ]]; then TPID=$(echo "$line" | cut -d' ' -f2); break; fi
done
[ -n "$TPID" ] || { echo "FAIL: target never said READY"; exit 1; }
# The driver's layout (the segment hole that once named its frames 0x200000
# off at a --pid attach): its mappings in the target and its PT_LOADs.
grep -F "$(basename "$LIBCUDA")" /proc/$TPID/maps >"$OUT/libcuda_maps.txt"
python3 -c "import sys; from pyctl import elf; f = elf.ElfFile.open(sys.argv[1]); [print(hex(s.offset), hex(s.vaddr), hex(s.filesz), s.flags) for s in f.loads]" "$LIBCUDA" >>"$OUT/libcuda_maps.txt"
cat "$OUT/libcuda_maps.txt"
t0=$(date +%s%N)
python3 -m pyctl inject --pid "$TPID" --lib "$LIBCUDA" --fn cuMemAlloc_v2 --action fail \
    --ret CUDA_ERROR_OUT_OF_MEMORY --sticky --duration 150s --db "$DB" --ready-fd 3 \
    --stack-copy "${STACK_COPY:-32K}" \
    3>$W/ready >$W/inject.log 2>&1 &
INJ=$!
read -r -t 120 rl <$W/ready
t1=$(date +%s%N)
echo "inject: '$rl' attach took $(( (t1 - t0) / 1000000 )) ms"
[ -n "$rl" ] || { echo "FAIL: inject never ready"; cat $W/inject.log; kill "$TPID"; exit 1; }
echo go >&5
while IFS= read -r -t 150 line <&4; do echo "target: $line"; done
wait "$INJ"; echo "inject rc=$? $(date -u +%T.%N)"
tail -15 $W/inject.log
python3 -m pyctl show latest --db "$DB" | tee "$OUT/pyframes_hf.txt"
python3 -m pyctl show latest --db "$DB" --json >"$OUT/pyframes_hf.json"; echo "show --json rc=$?"
cp $W/inject.log "$OUT/inject.log"
python3 - "$DB" "$OUT" <<'PY'
import json, sys
from pyctl.evidence import query, store
db, out = sys.argv[1], sys.argv[2]
conn = store.open_db(db, readonly=True)
fids = [r[0] for r in conn.execute("SELECT fault_id FROM faults ORDER BY seq")]
res = {"faults": len(fids), "each": []}
for fid in fids:
    doc = query.fault_chain(conn, fid)
    st, py = doc["stack"], doc["pyframes"]
    fns = [p["function"] for p in py]
    syms = [f["symbol"] or "" for f in st]
    def first(pred):
        return next((i for i, s in enumerate(syms) if pred(s)), None)
    cuda = first(lambda s: "libcuda.so" in s)
    alloc = first(lambda s: "CUDACachingAllocator" in s)
    evalf = first(lambda s: "_PyEval_EvalFrameDefault" in s)
    res["each"].append({
        "fault": fid, "native": len(st), "python": len(py),
        "python_read": (doc["fault"]["outcome"] or {}).get("python"),
        "methods": sorted({f["method"] for f in st if f["method"]}),
        "no_module": [f["depth"] for f in st if not f["module"]],
        "unnamed": [s for s in syms if s.startswith("0x") or "!" not in s and "+0x" not in s],
        "stop": doc.get("stack_stop"),
        "order_libcuda_alloc_eval": [cuda, alloc, evalf],
        "ordered": None not in (cuda, alloc, evalf) and cuda < alloc < evalf,
        "frame0": syms[0] if syms else None,
        "frame0_is_cuMemAlloc_v2": bool(syms) and "!cuMemAlloc_v2+0x0" in syms[0],
        "cudart": [s for s in syms if "libcudart" in s][:4],
        "forward": [f for f in fns if f.endswith(".forward")],
        "generate": [f for f in fns if "generate" in f or f.endswith("._sample")],
        "top_python": fns[:3], "bottom_python": fns[-2:]})
json.dump(res, open(f"{out}/pyframes_hf_check.json", "w"), indent=1, default=str)
print(json.dumps(res, indent=1, default=str))
PY
