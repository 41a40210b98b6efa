"""In-kernel summaries (bpf/aggregate.bpf.c): what counting and latency
histograms cost per call, against the kernel's floor and bpftrace, all in
one run on the same function; and tokenizer encode with counting on.

1. Per-call cost of gf_empty (build/targets/libgftarget.so, first
   instruction `push %rbp`) called in a tight loop by gf_target, ns/call,
   rounds interleaved (A B C ... A B C ...): each ratio is computed per
   round (a configuration against its floor measured seconds apart, so a
   machine shared with other jobs hits both alike) and the median of the
   rounds is the result; the best round of each is kept too:
   - no probe;
   - an empty uprobe program (the floor for entry-only counting);
   - gpufault count-only (`calls live --count-only`: agg_count);
   - an empty uprobe + uretprobe pair (the floor for latency);
   - gpufault count + latency: agg_session on a uprobe session link (6.12+,
     the default here), and agg_entry + agg_return (an entry uprobe and a
     uretprobe, the entry time in task storage: older kernels' way);
   - bpftrace `uprobe:LIB:gf_empty { @[probe] = count(); }`;
   - bpftrace latency: `@s[tid] = nsecs` at entry, `hist(nsecs - @s[tid])`
     at return.
   The floors use the same link kind as gpufault (uprobe_multi where the
   kernel has it); bpftrace 0.17 attaches one perf-event uprobe per probe.
   Ratios are probe costs (ns/call minus no probe) over the floor's.
2. Tokenizer encode throughput, 100k short texts, HF tokenizers and
   tiktoken, 1 and 8 threads, unprobed vs in-kernel counting on the encode
   entry point (`tok:hf-encode`, `tok:tiktoken-encode-ordinary`: what
   encode(text, add_special_tokens=False) and encode_ordinary() reach):
   an empty uprobe there (the kernel's floor), gpufault count-only and
   count + latency; rounds interleaved, median of each.

Needs root, `make build`, bpftrace (optional: its rows are then absent).
Prints JSON; about 2 minutes on the 2-core dev VM.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # an installed gpufault (the wheel) wins, else this checkout
sys.path.insert(0, str(REPO / "tests"))

from bench_tokenizer_bpf import lib_path  # noqa: E402 - the tokenizers' extension modules
from gftarget import LIB, Target  # noqa: E402

from pyctl import paths  # noqa: E402
from pyctl.bpf.libbpf import BPF_TRACE_UPROBE_MULTI, Object  # noqa: E402
from pyctl.calls.aggregate import Aggregator  # noqa: E402
from pyctl.capabilities import uprobe_multi  # noqa: E402
from pyctl.symbols import resolve  # noqa: E402

N = int(os.environ.get("GF_BENCH_CALLS", "500000"))
ROUNDS = int(os.environ.get("GF_BENCH_ROUNDS", "5"))
TEXTS = int(os.environ.get("GF_BENCH_TEXTS", "100000"))
TOK_ROUNDS = int(os.environ.get("GF_BENCH_TOK_ROUNDS", "5"))


def ns_per_call(t: Target, n: int = N) -> float:
    (line,) = [x for x in t.cmd(f"empty {n}") if x.startswith("ns_per_call")]
    return float(re.match(r"ns_per_call=([\d.]+)", line).group(1))  # type: ignore[union-attr]


# ---- probe configurations: each a context that attaches and detaches -----------
class Floor:
    """The empty program (bpf/bench.bpf.c) at entry, or at entry and return,
    on `fn` of `lib` in process `pid` (gf_empty in the target by default)."""

    def __init__(
        self, t: Target | None, pair: bool, *, pid: int = 0, lib: str = "", fn: str = "gf_empty"
    ):
        self.pid = t.pid if t is not None else pid
        self.lib, self.fn, self.pair = lib or str(LIB), fn, pair

    def __enter__(self) -> Floor:
        lib = resolve.find_library(self.lib, self.pid)
        (sym,) = resolve.symbols(lib, self.fn)
        self.obj = Object(paths.bpf_object("bench"))
        multi = uprobe_multi()
        if multi:
            self.obj.set_expected_attach_type("gf_bench_empty", BPF_TRACE_UPROBE_MULTI)
        self.obj.load()
        for ret in (True, False) if self.pair else (False,):
            if multi:
                self.obj.attach_uprobe_multi(
                    "gf_bench_empty", self.pid, lib.path, [sym.offset], [0], ret
                )
            else:
                self.obj.attach_uprobe("gf_bench_empty", self.pid, lib.path, sym.offset, 0, ret)
        return self

    def __exit__(self, *exc: object) -> None:
        self.obj.close()


class Gpufault:
    def __init__(self, t: Target, latency: bool, pair: bool = False):
        self.agg = Aggregator(t.pid, str(LIB), ["gf_empty"], latency=latency)
        self.pair = pair  # the older kernels' way (entry uprobe + uretprobe)

    def __enter__(self) -> Gpufault:
        if self.pair:
            os.environ["GPUFAULT_NO_UPROBE_SESSION"] = "1"
        try:
            self.agg.start()
        finally:
            os.environ.pop("GPUFAULT_NO_UPROBE_SESSION", None)
        self.mode = self.agg.mode
        return self

    def __exit__(self, *exc: object) -> None:
        s = self.agg.read()
        self.calls = s.functions[0].calls
        self.agg.close()


BT_COUNT = "uprobe:{lib}:gf_empty {{ @[probe] = count(); }}"
BT_HIST = (
    "uprobe:{lib}:gf_empty {{ @s[tid] = nsecs; }} "
    "uretprobe:{lib}:gf_empty /@s[tid]/ {{ @h = hist(nsecs - @s[tid]); delete(@s[tid]); }}"
)


class Bpftrace:
    """bpftrace on the target; live once a short loop is clearly slower."""

    def __init__(self, t: Target, prog: str, base: float):
        self.t, self.prog, self.base = t, prog.format(lib=LIB), base

    def __enter__(self) -> Bpftrace:
        self.p = subprocess.Popen(
            ["bpftrace", "-p", str(self.t.pid), "-e", self.prog],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.p.stdout is not None
        # 0.17 warns first when it cannot raise RLIMIT_MEMLOCK (not needed
        # on 5.11+ kernels, which account BPF memory to the cgroup).
        seen = []
        while not (line := self.p.stdout.readline()).startswith("Attaching"):
            seen.append(line.strip())
            if not line:
                raise RuntimeError(f"bpftrace: {' / '.join(seen)}")
        deadline = time.monotonic() + 20
        while ns_per_call(self.t, 20_000) < self.base + 200:
            if time.monotonic() > deadline or self.p.poll() is not None:
                raise RuntimeError("bpftrace probes never went live")
        return self

    def __exit__(self, *exc: object) -> None:
        # SIGINT: bpftrace prints its maps and detaches (perf-event
        # uprobes: an RCU wait each); one that hangs is killed, not waited for.
        self.p.send_signal(2)
        try:
            self.output, _ = self.p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.output = self.p.communicate()[0] or ""


def probe_costs(t: Target) -> dict:
    base_runs = [ns_per_call(t) for _ in range(2)]
    base = min(base_runs)
    configs: dict[str, Callable[[], object]] = {
        "empty_uprobe_floor": lambda: Floor(t, pair=False),
        "gpufault_count_only": lambda: Gpufault(t, latency=False),
        "empty_uprobe_uretprobe_pair_floor": lambda: Floor(t, pair=True),
        "gpufault_count_latency": lambda: Gpufault(t, latency=True),
        "gpufault_count_latency_uretprobe": lambda: Gpufault(t, latency=True, pair=True),
    }
    if shutil.which("bpftrace"):
        configs["bpftrace_count"] = lambda: Bpftrace(t, BT_COUNT, base)
        configs["bpftrace_latency_hist"] = lambda: Bpftrace(t, BT_HIST, base)
    vals: dict[str, list[float]] = {k: [] for k in configs}
    vals["no_probe"] = list(base_runs)
    checks: dict[str, object] = {}
    for _ in range(ROUNDS):
        vals["no_probe"].append(ns_per_call(t))
        for name, make in configs.items():
            ctx = make()
            with ctx:  # type: ignore[attr-defined]
                vals[name].append(ns_per_call(t))
            if isinstance(ctx, Gpufault):
                checks[f"{name}_calls_counted"] = ctx.calls
                checks[f"{name}_mode"] = ctx.mode
            if isinstance(ctx, Bpftrace):
                m = re.search(r"\]: (\d+)", ctx.output)
                if m:
                    checks[f"{name}_count"] = int(m.group(1))
    best = {k: min(v) for k, v in vals.items()}
    b = best["no_probe"]
    cost = {k: round(v - b, 1) for k, v in best.items()}
    pairs = {
        "count_only_vs_empty_uprobe": ("gpufault_count_only", "empty_uprobe_floor"),
        "count_latency_vs_pair": ("gpufault_count_latency", "empty_uprobe_uretprobe_pair_floor"),
        "count_latency_uretprobe_vs_pair": (
            "gpufault_count_latency_uretprobe",
            "empty_uprobe_uretprobe_pair_floor",
        ),
        "count_only_vs_bpftrace_count": ("gpufault_count_only", "bpftrace_count"),
        "count_latency_vs_bpftrace_hist": ("gpufault_count_latency", "bpftrace_latency_hist"),
    }

    def round_ratios(a: str, f: str) -> list[float]:
        # Per round: both measured minutes apart at most, so a busy machine
        # (other jobs come and go) hits both alike; the median is the result.
        base = vals["no_probe"][2:]
        return [
            round((x - nb) / (y - nb), 3)
            for x, y, nb in zip(vals[a], vals[f], base, strict=False)
            if y - nb > 0
        ]

    per_round = {k: round_ratios(a, f) for k, (a, f) in pairs.items() if a in vals and f in vals}
    return {
        "calls_per_measure": N,
        "rounds": ROUNDS,
        "per_call_ns_best": {k: round(v, 1) for k, v in best.items()},
        "per_call_ns_all": {k: [round(x, 1) for x in v] for k, v in vals.items()},
        "probe_cost_ns_best": cost,
        "ratios_median_of_rounds": {
            k: round(statistics.median(v), 3) for k, v in per_round.items() if v
        },
        "ratios_per_round": per_round,
        "ratios_of_best": {
            k: round(cost[a] / cost[f], 3)
            for k, (a, f) in pairs.items()
            if a in cost and f in cost and cost[f] > 0
        },
        "checks": checks,
        "link_kind": "uprobe_multi" if uprobe_multi() else "perf-event uprobe",
    }


# ---- tokenizers ------------------------------------------------------------------------
WORKER = textwrap.dedent("""
    import sys, threading, time
    from pyctl.tokenizer.builders import build_hf_bpe, build_tiktoken, generate_corpus
    words = " ".join(generate_corpus(2000, seed=9)).split()
    n = int(sys.argv[1])
    texts = [" ".join(words[i % len(words): i % len(words) + 4]) for i in range(n)]
    hf = build_hf_bpe(1000)
    tk = build_tiktoken()
    encs = {"hf": lambda t: hf.encode(t, add_special_tokens=False), "tiktoken": tk.encode_ordinary}
    print("ready", flush=True)
    for line in sys.stdin:
        lib, threads = line.split()
        threads = int(threads)
        enc = encs[lib]
        chunks = [texts[k::threads] for k in range(threads)]
        barrier = threading.Barrier(threads + 1)
        def work(chunk):
            barrier.wait()
            for t in chunk:
                enc(t)
        pool = [threading.Thread(target=work, args=(c,)) for c in chunks]
        for th in pool:
            th.start()
        barrier.wait()
        t0 = time.perf_counter()
        for th in pool:
            th.join()
        print(len(texts) / (time.perf_counter() - t0), flush=True)
""")

KIND = {"hf": "tok:hf-encode", "tiktoken": "tok:tiktoken-encode-ordinary"}


def tokenizer_overhead() -> dict:
    p = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(TEXTS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert p.stdin and p.stdout
    assert p.stdout.readline().strip() == "ready"

    def rate(lib: str, threads: int) -> float:
        p.stdin.write(f"{lib} {threads}\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        return float(p.stdout.readline())  # type: ignore[union-attr]

    out: dict = {"texts": TEXTS}
    try:
        for lib in ("hf", "tiktoken"):
            for threads in (1, 8):
                rate(lib, threads)  # warm-up
                runs: dict[str, list[float]] = {
                    "base": [],
                    "empty_uprobe": [],
                    "count_only": [],
                    "count_latency": [],
                }
                hits: dict[str, int] = {}
                for _ in range(TOK_ROUNDS):
                    runs["base"].append(rate(lib, threads))
                    # The kernel's floor on the same site: an empty program.
                    with Floor(None, False, pid=p.pid, lib=lib_path(lib), fn=KIND[lib]):
                        runs["empty_uprobe"].append(rate(lib, threads))
                    for mode, lat in (("count_only", False), ("count_latency", True)):
                        with Aggregator(p.pid, lib_path(lib), [KIND[lib]], latency=lat) as agg:
                            runs[mode].append(rate(lib, threads))
                            hits[mode] = agg.read().calls
                med = {k: statistics.median(v) for k, v in runs.items()}
                out[f"{lib}_{threads}t"] = {
                    "texts_per_s": round(med["base"]),
                    "texts_per_s_empty_uprobe": round(med["empty_uprobe"]),
                    "overhead_pct_empty_uprobe": round(
                        (med["base"] / med["empty_uprobe"] - 1) * 100, 2
                    ),
                    "texts_per_s_count_only": round(med["count_only"]),
                    "texts_per_s_count_latency": round(med["count_latency"]),
                    "overhead_pct_count_only": round(
                        (med["base"] / med["count_only"] - 1) * 100, 2
                    ),
                    "overhead_pct_count_latency": round(
                        (med["base"] / med["count_latency"] - 1) * 100, 2
                    ),
                    "probe_hits_last_round": hits,
                    "all": {k: [round(x) for x in v] for k, v in runs.items()},
                }
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    return out


def main() -> None:
    out: dict = {
        "machine": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0],
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if shutil.which("bpftrace"):
        v = subprocess.run(["bpftrace", "--version"], capture_output=True, text=True).stdout
        out["bpftrace"] = v.strip()
    which = sys.argv[1:] or ["probe", "tokenizer"]
    t = Target()
    try:
        if "probe" in which:
            out["probe_cost"] = probe_costs(t)
    finally:
        t.close()
    if "tokenizer" in which:
        out["tokenizer"] = tokenizer_overhead()
    out["load_after"] = os.getloadavg()[0]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
