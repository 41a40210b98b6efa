"""gpufault's BPF engine on the real `tokenizers` wheel: probes on the
encode entry points (found by demangled name) count exactly the encode calls
a multi-threaded workload made, per thread, with latency."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from pyctl.engine import Engine
from pyctl.spec import FaultSpec

pytestmark = [pytest.mark.root]
tokenizers = pytest.importorskip("tokenizers")

WORKLOAD = textwrap.dedent("""
    import sys, threading
    from pyctl.tokenizer.builders import build_hf_bpe
    tok = build_hf_bpe(300, ["hello world, the quick brown fox"] * 50)
    print("ready", flush=True)
    n, t = (int(x) for x in sys.stdin.readline().split())
    import threading
    tids = []
    def work():
        tids.append(threading.get_native_id())
        for i in range(n):
            tok.encode(f"text number {i} with some words")
    ths = [threading.Thread(target=work) for _ in range(t)]
    [x.start() for x in ths]; [x.join() for x in ths]
    print("tids", *tids, flush=True)
    sys.stdin.readline()
""")


def test_encode_calls_counted_exactly_per_thread(tmp_path: Path) -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", WORKLOAD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert p.stdout is not None and p.stdin is not None
    try:
        assert p.stdout.readline().strip() == "ready"
        lib = str(Path(tokenizers.__file__).parent / "tokenizers.abi3.so")
        db = tmp_path / "gf.db"
        eng = Engine(
            [FaultSpec(lib=lib, fn="tok:hf-encode", trace=True, tgid=p.pid)],
            db_path=db,
            pid=p.pid,
            argv=["tok"],
        )
        eng.start()
        try:
            p.stdin.write("250 4\n")
            p.stdin.flush()
            tids = [int(x) for x in p.stdout.readline().split()[1:]]
            eng.drain()
            assert eng.lost()["events_lost"] == 0
        finally:
            eng.close()
        con = sqlite3.connect(db)
        per_tid = Counter(t for (t,) in con.execute("SELECT tid FROM calls"))
        lat = [x for (x,) in con.execute("SELECT latency_ns FROM calls")]
        assert dict(per_tid) == {t: 250 for t in tids}
        assert all(x > 0 for x in lat)
    finally:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=30)
