"""A database with one run's evidence, written through the store's own
functions (no root, no BPF): what a copilot OOM fault, a corrupt fault and
an injected SIGSEGV leave behind, with their links, an Xid and an anchor.
Used by test_show_words, test_timeline and test_datasette."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from pyctl.bpf import abi
from pyctl.evidence import store

LIBCUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
# The monotonic clock at the run's start; every event is an offset from it.
T0 = 1_000_000_000_000
MS = 1_000_000


def fill(path: Path) -> dict[str, Any]:
    """Write the run; returns its ids and the fault ids."""
    db = store.open_db(path)
    run = store.new_run(db, ["gpufault", "inject", "..."], "inject", mechanism="copilot")
    started = db.conn.execute("SELECT started FROM runs WHERE run_id=?", (run,)).fetchone()[0]

    def wall(ns: int) -> float:
        return started + (ns - T0) / 1e9

    f1, f2, f3 = (store.fault_id(run, i) for i in (1, 2, 3))
    specs = [
        (
            "libcuda:cuMemAlloc_v2 fail ret=CUDA_ERROR_OUT_OF_MEMORY mode=skip nth=3",
            {"action": "fail", "ret": 2, "mode": "skip"},
        ),
        ("libc:memset corrupt", {"action": "corrupt", "corrupt": [1, 0, 0, 0, 8]}),
        ("libc:malloc signal SIGSEGV", {"action": "signal", "signo": 11}),
    ]
    with db.conn:
        for i, (text, js) in enumerate(specs):
            db["specs"].insert({"run_id": run, "spec": i, "text": text, "json": json.dumps(js)})
        for i, (lib, sym) in enumerate(
            [(LIBCUDA, "cuMemAlloc_v2"), (LIBC, "memset"), (LIBC, "malloc")]
        ):
            db["funcs"].insert(
                {
                    "run_id": run,
                    "func": i,
                    "library": lib,
                    "symbol": sym,
                    "build_id": "ab" * 20,
                    "offset": 0x1000 * (i + 1),
                }
            )
        base = {"run_id": run, "pid": 4242, "tid": 4243, "comm": "gf-infer", "build_id": "ab" * 20}
        faults = [
            dict(
                base,
                fault_id=f1,
                seq=1,
                spec=0,
                func=0,
                function="cuMemAlloc_v2",
                library=LIBCUDA,
                action="fail",
                mechanism="copilot",
                retval=2,
                call_seq=3,
                ts_ns=T0 + 10 * MS,
                wall=wall(T0 + 10 * MS),
                ret=2,
                latency_ns=5_100_000,
                outcome=json.dumps(
                    {
                        "copilot": {
                            "tid": 4243,
                            "action": abi.ACT_FAIL,
                            "stop_ns": T0 + 10 * MS,
                            "resume_ns": T0 + 10 * MS + 5_100_000,
                            "ip_before": 0x7F0000001000,
                            "ip_after": 0x55550000ABCD,
                            "ret_addr": 0x55550000ABCD,
                            "error": None,
                        },
                        "injected": True,
                    }
                ),
            ),
            dict(
                base,
                fault_id=f2,
                seq=2,
                spec=1,
                func=1,
                function="memset",
                library=LIBC,
                action="corrupt",
                mechanism="copilot",
                retval=None,
                call_seq=1,
                ts_ns=T0 + 20 * MS,
                wall=wall(T0 + 20 * MS),
                ret=None,
                latency_ns=None,
                outcome=json.dumps(
                    {"corrupt_addr": 0x7FFD12345678, "corrupt_error": None, "injected": True}
                ),
            ),
            dict(
                base,
                fault_id=f3,
                seq=3,
                spec=2,
                func=2,
                function="malloc",
                library=LIBC,
                action="signal",
                mechanism="bpf",
                retval=None,
                call_seq=7,
                ts_ns=T0 + 30 * MS,
                wall=wall(T0 + 30 * MS),
                ret=None,
                latency_ns=None,
                outcome=json.dumps({"signal": 11}),
            ),
        ]
        for row in faults:
            db["faults"].insert(row)
        for reg, v in (("ip", 0x7F0000001000), ("sp", 0x7FFD00000000), ("ax", -1)):
            db["registers"].insert({"fault_id": f1, "reg": reg, "value": abi.s64(v)})
        db["args"].insert(
            {
                "fault_id": f1,
                "idx": 1,
                "name": "dptr",
                "raw": abi.s64(0x7F6921DFEDE0),
                "decoded": "0x7f6921dfede0",
            }
        )
        db["args"].insert(
            {
                "fault_id": f1,
                "idx": 2,
                "name": "bytesize",
                "raw": 4 << 20,
                "decoded": "4194304 (4 MiB)",
            }
        )
        db["stacks"].insert(
            {
                "fault_id": f1,
                "depth": 0,
                "address": abi.s64(0xFFFF7F7379659A00),
                "symbol": "libcuda.so.1!cuMemAlloc_v2+0x0",
            }
        )
        links = [
            (f1, "error-return", "same-thread-next-error", T0 + 12 * MS, {"func": 0, "ret": 2}),
            (
                f3,
                "signal",
                "signal-in-faulted-process",
                T0 + 31 * MS,
                {"signal": 11, "code": 1, "cause": "injected signal"},
            ),
            (
                f3,
                "exit",
                "exit-of-faulted-process",
                T0 + 40 * MS,
                {"exit_status": 0, "term_signal": 11, "core": True},
            ),
            (
                None,
                "signal",
                "unattributed",
                T0 + 5 * MS,
                {"signal": 17, "code": 1, "why": "this signal cannot follow from a fault"},
            ),
        ]
        for fid, kind, rule, ts, detail in links:
            db["links"].insert(
                {
                    "fault_id": fid,
                    "run_id": run,
                    "kind": kind,
                    "rule": rule,
                    "ts_ns": ts,
                    "pid": 4242,
                    "tid": 4243,
                    "detail": json.dumps(detail),
                }
            )
        db["xids"].insert(
            {
                "fault_id": f1,
                "run_id": run,
                "dev": "0000:01:00.0",
                "error_code": 31,
                "msg": "MMU fault",
                "ts_ns": T0 + 15 * MS,
                "pid": 4242,
                "tid": 4243,
                "rule": "xid-on-device-of-faulted-process",
            }
        )
        db["anchors"].insert(
            {
                "fault_id": f1,
                "kind": "reset_begin",
                "run_id": 1,
                "rec_seq": 9,
                "mono_ns": T0 + 18 * MS,
                "bdf": "0000:01:00.0",
                "code": 0,
            }
        )
    store.end_run(db, run, "done", exit_code=139)
    with db.conn:  # ended 50 ms after the start, after every event above
        db.conn.execute("UPDATE runs SET ended=? WHERE run_id=?", (started + 0.05, run))
    db.close()
    return {"run": run, "faults": [f1, f2, f3], "started": started}


def gf(*args: str) -> tuple[int, str]:
    """`gpufault ARGS` in-process: (exit code, output)."""
    from pyctl.cli import cli

    r = CliRunner().invoke(cli, list(args))
    return r.exit_code, r.output
