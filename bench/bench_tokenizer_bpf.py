"""Overhead of gpufault observe probes (BPF engine, one event per call) on
tokenizer encode throughput: 100k short texts, 1 thread and 8 threads, HF
`tokenizers` and `tiktoken`, without and with the probe, in one run.

The workload runs in a child process (the engine probes a running pid);
the probe is on the encode entry point found by demangled name
(`tok:hf-encode`, `tok:tiktoken-encode`). Prints JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.append(str(REPO))  # an installed gpufault (the wheel) wins, else this checkout

from pyctl.engine import Engine  # noqa: E402
from pyctl.spec import FaultSpec  # noqa: E402

WORKER = textwrap.dedent("""
    import sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pyctl.tokenizer.builders import build_hf_bpe, build_tiktoken, generate_ranks
    hf = build_hf_bpe(2000, ["the quick brown fox jumps over the lazy dog %d" % i
                             for i in range(500)])
    tk = build_tiktoken(generate_ranks(2000))
    texts = ["short text number %d, hello world" % i for i in range(100_000)]
    print("ready", flush=True)
    for line in sys.stdin:
        lib, threads = line.split()
        threads = int(threads)
        enc = hf.encode if lib == "hf" else tk.encode
        chunks = [texts[i::threads] for i in range(threads)]
        def run(chunk):
            for t in chunk:
                enc(t)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(run, chunks))
        print(len(texts) / (time.perf_counter() - t0), flush=True)
""")

KIND = {"hf": "tok:hf-encode", "tiktoken": "tok:tiktoken-encode"}


def lib_path(lib: str) -> str:
    if lib == "hf":
        import tokenizers

        return str(Path(tokenizers.__file__).parent / "tokenizers.abi3.so")
    import tiktoken._tiktoken as t

    return t.__file__


def main() -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert p.stdin and p.stdout
    assert p.stdout.readline().strip() == "ready"

    def rate(lib: str, threads: int) -> float:
        p.stdin.write(f"{lib} {threads}\n")
        p.stdin.flush()
        return float(p.stdout.readline())

    out: dict = {"texts": 100_000}
    with tempfile.TemporaryDirectory() as d:
        for lib in ("hf", "tiktoken"):
            for threads in (1, 8):
                rate(lib, threads)  # warm-up
                base = max(rate(lib, threads) for _ in range(2))
                eng = Engine(
                    [
                        FaultSpec(
                            lib=lib_path(lib),
                            fn=KIND[lib],
                            trace=True,
                            entry_only=True,
                            capture_stack=False,
                            tgid=p.pid,
                        )
                    ],
                    db_path=Path(d) / f"{lib}{threads}.db",
                    pid=p.pid,
                )
                eng.start()
                try:
                    # The workload runs from a helper thread; this thread is
                    # the engine's consumer, as in real use.
                    import threading

                    got: list[float] = []

                    def drive(got=got, lib=lib, threads=threads) -> None:
                        got.extend(rate(lib, threads) for _ in range(2))

                    th = threading.Thread(target=drive)
                    th.start()
                    while th.is_alive():
                        eng.poll(0.01)
                    th.join()
                    probed = max(got)
                    while eng.drain():
                        pass
                    calls = eng.counters()[0].calls
                    lost = eng.lost()["events_lost"]
                finally:
                    eng.close()
                out[f"{lib}_{threads}t"] = {
                    "texts_per_s": round(base),
                    "texts_per_s_probed": round(probed),
                    "slowdown_pct": round((base / probed - 1) * 100, 2),
                    "probe_hits": calls,
                    "lost": lost,
                }
    p.stdin.close()
    p.wait()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
