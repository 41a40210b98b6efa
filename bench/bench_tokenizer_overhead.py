"""Overhead of observe probes on encode throughput, as a ratio in one run.

100k short texts through tiktoken and HF tokenizers (built in-process),
with 1 thread and with 8 threads, alternating unprobed and probed rounds
(ABAB..., the median of each) so drift hits both sides alike. Probed = a
uprobe on the library's encode entry point (hf-encode / tiktoken-encode)
that records one trace event per call into a private tracefs instance:
the same kernel path (uprobe trap + one record) as a BPF observe probe.
Needs root. Usage: python3 bench/bench_tokenizer_overhead.py [--n 100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from pyctl.symbols import tokenizers as symbols
from pyctl.tokenizer.builders import build_hf_bpe, build_tiktoken, generate_corpus
from pyctl.tokenizer.uprobe_count import UprobeCounter, tracefs_ready


def texts(n: int) -> list[str]:
    words = " ".join(generate_corpus(2000, seed=9)).split()
    return [" ".join(words[i % len(words) : i % len(words) + 4]) for i in range(n)]


def throughput(encode, items: list[str], threads: int) -> float:
    chunks = [items[k::threads] for k in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def work(chunk: list[str]) -> None:
        barrier.wait()
        for t in chunk:
            encode(t)

    pool = [threading.Thread(target=work, args=(c,)) for c in chunks]
    for th in pool:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    for th in pool:
        th.join()
    return len(items) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    why = tracefs_ready()
    if why:
        print(f"skip: {why}", file=sys.stderr)
        return 2
    items = texts(a.n)
    hf = build_hf_bpe(1000)
    enc = build_tiktoken()
    libs = {
        "tiktoken": (enc.encode_ordinary, "tiktoken", "tiktoken-encode-ordinary"),
        "hf": (lambda t: hf.encode(t, add_special_tokens=False), "tokenizers", "hf-encode"),
    }
    results = []
    for name, (fn, lib, kind) in libs.items():
        points = symbols.find_entry_points(symbols.library_of_module(lib), kind)
        for threads in (1, 8):
            base: list[float] = []
            probed: list[float] = []
            hits = 0
            for _ in range(a.rounds):
                base.append(throughput(fn, items, threads))
                with UprobeCounter(points) as c:
                    probed.append(throughput(fn, items, threads))
                    hits = sum(c.counts().values())
            b, p = statistics.median(base), statistics.median(probed)
            results.append(
                {
                    "lib": name,
                    "threads": threads,
                    "base_per_s": round(b),
                    "probed_per_s": round(p),
                    "overhead_pct": round(100 * (b / p - 1), 2),
                    "events_last_round": hits,
                }
            )
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"{'lib':<9} {'thr':>3} {'base/s':>9} {'probed/s':>9} {'overhead':>8} {'events':>7}")
        for r in results:
            print(
                f"{r['lib']:<9} {r['threads']:>3} {r['base_per_s']:>9} {r['probed_per_s']:>9}"
                f" {r['overhead_pct']:>7.2f}% {r['events_last_round']:>7}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
