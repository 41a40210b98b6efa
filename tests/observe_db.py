"""A synthetic evidence database for the observability and report tests:
the experiment tables the experiment runner writes (their schema as agreed
with it, issue 14), plus faults, Xids and anchors through the store's own
schema, with numbers shaped like a real run (a baseline, a stall that
raises the p99 and the error rate, recovery)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pyctl.evidence import anchors as anchor_store
from pyctl.evidence import schema, store

# The experiment tables as gpufault defines them (pyctl/evidence/schema.py).
EXPERIMENT_DDL = schema.script(schema.EXPERIMENT_TABLES)

T0 = 1_796_000_000.0  # a fixed wall clock: reports render the same every time


def _ins(db: Any, table: str, row: dict[str, Any]) -> None:
    cols = ", ".join(row)
    qs = ", ".join("?" for _ in row)
    db.conn.execute(f"INSERT INTO {table} ({cols}) VALUES ({qs})", tuple(row.values()))


def make_db(path: Path) -> Any:
    db = store.open_db(path)
    # The store creates every table itself (pyctl/evidence/schema.py); the
    # DDL here is the agreed experiment schema, a no-op where it exists.
    db.conn.executescript(EXPERIMENT_DDL)
    anchor_store.ensure_schema(db)
    return db


def add_experiment(
    db: Any,
    exp_id: str,
    *,
    name: str,
    slo_id: str = "chat-p99",
    t0: float = T0,
    verdict: str = "fail",
    stall_ms: float = 50.0,
    run_id: str = "1a2b3c4d",
    fires: int = 6,
    xid: bool = True,
    alert: bool | None = True,
    steady: dict[str, str] | None = None,  # the file's [steady_state] bounds
    armed_after: float = 0.05,  # the step's start after its planned one
    degraded: bool | None = True,
    recovered: float | None = 3.0,
    errors: bool = True,
) -> None:
    """A 40 s experiment: baseline 0-10 s, a fault step 10-25 s, recovery."""
    with db.conn:
        _ins(
            db,
            "experiments",
            {
                "id": exp_id,
                "name": name,
                "version": 1,
                "file": f"{name}.toml",
                "slo_id": slo_id,
                "started_at": t0,
                "ended_at": t0 + 40,
                "verdict": verdict,
                "reason": "p99 above 100 ms in the fault window" if verdict == "fail" else "",
                "settings": json.dumps(
                    {
                        "knobs": {"rate": 50},
                        "file": {
                            "expect": {"recovered_within": {"within": "30s", "hold": "3s"}},
                            **({"steady_state": steady} if steady else {}),
                        },
                    }
                ),
                "host": "ci-vm",
            },
        )
        _ins(
            db,
            "experiment_steps",
            {
                "experiment_id": exp_id,
                "idx": 0,
                "name": "stall-encode",
                "template": "tokenizer-stall",
                "spec": json.dumps(
                    {
                        "lib": "tokenizers",
                        "fn": "tok:hf-encode",
                        "action": "stall",
                        "stall": f"{stall_ms:g}ms",
                    }
                ),
                "run_id": run_id,
                "planned_start": t0 + 10,
                "planned_duration": 15,
                "started_at": t0 + 10 + armed_after,
                "ended_at": t0 + 25.02,
                "fires": fires,
                "status": "done",
            },
        )
        for i in range(40):
            s = t0 + i
            phase = (
                "baseline" if i < 10 else "fault" if i < 25 else "recovery" if i < 28 else "after"
            )
            bump = stall_ms / 1000 if phase == "fault" else 0.0
            wiggle = 0.002 * math.sin(i)
            _ins(
                db,
                "load_windows",
                {
                    "experiment_id": exp_id,
                    "start": s,
                    "end": s + 1,
                    "count": 50,
                    "p50": 0.016 + wiggle + bump * 0.3,
                    "p95": 0.025 + bump * 0.8,
                    "p99": 0.032 + wiggle + bump * (1.0 + 0.4 * math.sin(i)),
                    "error_rate": (0.08 if errors and phase == "fault" and i % 3 == 0 else 0.0),
                    "throughput": 50 - (10 if phase == "fault" else 0),
                    "phase": phase,
                },
            )
            _ins(
                db,
                "probe_samples",
                {
                    "experiment_id": exp_id,
                    "probe": "health",
                    "phase": phase,
                    "at": s + 0.5,
                    "ok": 1,
                    "value": 200,
                    "detail": "",
                },
            )
        for phase, ok, val in (
            ("before", 1, "32 ms"),
            ("during", 0, f"{32 + stall_ms:g} ms"),
            ("after", 1, "33 ms"),
        ):
            _ins(
                db,
                "hypothesis_results",
                {
                    "experiment_id": exp_id,
                    "phase": phase,
                    "probe": "p99-latency",
                    "ok": ok,
                    "value": val,
                    "tolerance": "< 100 ms",
                    "detail": "",
                },
            )
            _ins(
                db,
                "hypothesis_results",
                {
                    "experiment_id": exp_id,
                    "phase": phase,
                    "probe": "health",
                    "ok": 1,
                    "value": "200",
                    "tolerance": "== 200",
                    "detail": "",
                },
            )
        _ins(
            db,
            "judgements",
            {
                "experiment_id": exp_id,
                "metric": "p99",
                "baseline_n": 10,
                "window_n": 15,
                "p_value": 1.2e-5,
                "effect": 2.4,
                "worse": 1,
                "reason": "Mann-Whitney U: fault window higher, effect 2.4 > 1.2",
            },
        )
        _ins(
            db,
            "judgements",
            {
                "experiment_id": exp_id,
                "metric": "error_rate",
                "baseline_n": 10,
                "window_n": 15,
                "p_value": 0.21,
                "effect": 0.3,
                "worse": 0,
                "reason": "no significant change",
            },
        )
        for nm, ok, val, det in (
            (
                "alert_fired",
                alert,
                4.2 if alert else None,
                "GfServiceP99High firing 4.2 s after the first fire"
                if alert
                else "GfServiceP99High never fired within 30 s of the first fire",
            ),
            (
                "degradation_worked",
                degraded,
                0.87 if degraded else 0.0,
                "degraded ok in 13 of 15 samples during the method",
            ),
            (
                "recovered_within",
                recovered is not None and recovered <= 30,
                recovered,
                f"the load hypothesis held for 3s from {recovered}s after the faults ended "
                "(want <= 30s)"
                if recovered is not None
                else "the load hypothesis never held for 3s after the faults ended (want <= 30s)",
            ),
        ):
            if ok is None:  # not asserted by this experiment
                continue
            _ins(
                db,
                "expectations",
                {"experiment_id": exp_id, "name": nm, "ok": int(ok), "value": val, "detail": det},
            )
        _ins(
            db,
            "remediations",
            {
                "experiment_id": exp_id,
                "command": "tighten-breaker.sh",
                "started_at": t0 + 12,
                "ended_at": t0 + 12.4,
                "rc": 0,
            },
        )
        # The run of the step and its faults, through the store's own schema.
        _ins(
            db,
            "runs",
            {
                "run_id": run_id,
                "argv": "[]",
                "kind": "experiment",
                "kernel": "6.1",
                "host": "ci-vm",
                "mechanism": "bpf",
                "capabilities": "{}",
                "started": t0 + 10,
                "ended": t0 + 25,
                "status": "done",
                "exit_code": None,
                "stats": "{}",
            },
        )
        _ins(
            db,
            "specs",
            {
                "run_id": run_id,
                "spec": 0,
                "text": "tokenizers:tok:hf-encode stall 50ms every 5",
                "json": "{}",
            },
        )
        for k in range(1, fires + 1):
            wall = t0 + 10.2 + k * 2.3
            fid = store.fault_id(run_id, k)
            _ins(
                db,
                "faults",
                {
                    "fault_id": fid,
                    "run_id": run_id,
                    "seq": k,
                    "spec": 0,
                    "func": 0,
                    "function": "tok:hf-encode",
                    "library": "/venv/tokenizers.abi3.so",
                    "build_id": "ab12",
                    "action": "stall",
                    "mechanism": "bpf",
                    "retval": None,
                    "call_seq": 5 * k,
                    "pid": 4242,
                    "tid": 4250 + k % 2,
                    "comm": "gf-http",
                    "ts_ns": int((wall - t0) * 1e9),
                    "wall": wall,
                    "ret": 0,
                    "latency_ns": int(stall_ms * 1e6),
                    "outcome": None,
                },
            )
            _ins(
                db,
                "stacks",
                {
                    "fault_id": fid,
                    "depth": 0,
                    "address": 0x7F00_0000_1000,
                    "symbol": "tokenizers.abi3.so!encode_char_offsets",
                    "module": None,
                    "offset": None,
                },
            )
        if xid:
            f3 = store.fault_id(run_id, 3)
            _ins(
                db,
                "xids",
                {
                    "fault_id": f3,
                    "run_id": run_id,
                    "dev": "0000:18:00.0",
                    "error_code": 31,
                    "msg": "MMU Fault: ENGINE GRAPHICS",
                    "ts_ns": int((10.2 + 3 * 2.3 + 0.4) * 1e9),
                    "pid": 4242,
                    "tid": 4251,
                    "rule": "xid-on-device-of-faulted-process",
                },
            )
            _ins(
                db,
                "anchors",
                {
                    "fault_id": f3,
                    "kind": "reset_begin",
                    "run_id": 0x1A2B3C4D,
                    "fault_seq": 3,
                    "from_context": 1,
                    "rec_seq": 1,
                    "mono_ns": 1,
                    "wall_ns": int((t0 + 18.0) * 1e9),
                    "bdf": "0000:18:00.0",
                    "vendor": 0x10DE,
                    "device": 0x2335,
                    "code": 0,
                    "pid": 4242,
                    "ctx_pid": 4242,
                    "comm": "gf-http",
                    "config_ok": 1,
                    "config": b"\0" * 4,
                    "devsta": 0,
                    "aer_pos": 0,
                    "aer": None,
                    "bar0": "{}",
                },
            )


def add_streaming_and_slo(db: Any, exp_id: str, *, t0: float = T0, slo: str = "chat-good",
                          thread: str | None = "gf-worker") -> None:  # fmt: skip
    """What a streamed [load] and a burn-rate [[slo]] add to add_experiment's
    run (schema 8): per-window TTFT/ITL percentiles and output tokens/s, the
    SLO's windows (half the fault window's requests bad) and its 14.4x
    12s/1s pair (firing from 12 s to 27 s), the step's thread name."""
    with db.conn:
        for i in range(40):
            fault = 10 <= i < 25
            db.conn.execute(
                "UPDATE load_windows SET ttft_p50 = ?, ttft_p95 = ?, ttft_p99 = ?, itl_p50 = ?, "
                "itl_p95 = ?, itl_p99 = ?, output_tokens_per_s = ?, goodput = ? "
                "WHERE experiment_id = ? AND start = ?",
                (0.010, 0.015, 0.020 + (0.050 if fault else 0.0), 0.004, 0.006,
                 0.008 + (0.060 if fault else 0.0), 400.0 - (150.0 if fault else 0.0),
                 0.5 if fault else 1.0, exp_id, t0 + i),
            )  # fmt: skip
            phase = "baseline" if i < 10 else "fault" if fault else "recovery"
            phase = "after" if i >= 28 else phase
            _ins(db, "slo_windows", {"experiment_id": exp_id, "slo_id": slo, "start": t0 + i,
                                     "end": t0 + i + 1, "phase": phase, "total": 50,
                                     "good": 25 if fault else 50})  # fmt: skip
            long_ = min(i + 1, 12)
            bad = sum(25 for k in range(i + 1 - long_, i + 1) if 10 <= k < 25)
            lb = bad / (50 * long_) / 0.01
            sb = (25 / 50 / 0.01) if fault else 0.0
            _ins(db, "slo_burns", {"experiment_id": exp_id, "slo_id": slo,
                                   "alert": "14.4x 12s/1s", "long_s": 12.0, "short_s": 1.0,
                                   "factor": 14.4, "at": t0 + i + 1, "phase": phase,
                                   "long_burn": lb, "short_burn": sb,
                                   "firing": int(lb > 14.4 and sb > 14.4)})  # fmt: skip
        _ins(db, "hypothesis_results", {"experiment_id": exp_id, "phase": "during",
                                        "probe": f"slo.{slo}", "ok": 0, "value": "41.7x",
                                        "tolerance": "burn <= 14.4x over 12s or 1s",
                                        "detail": "", "slo_id": slo})  # fmt: skip
        db.conn.execute("UPDATE experiment_steps SET thread_name = ? WHERE experiment_id = ?",
                        (thread, exp_id))  # fmt: skip
        sql = "SELECT settings FROM experiments WHERE id = ?"
        (raw,) = db.conn.execute(sql, (exp_id,)).fetchone()
        settings = json.loads(raw)
        f = settings["file"]
        f["steady_state"] = {**f.get("steady_state", {}), "ttft_p99": "<= 50ms",
                             "itl_p99": "<= 30ms"}  # fmt: skip
        f["slo"] = [{"id": slo, "objective": "99%", "good": {"itl": "<= 30ms"}}]
        db.conn.execute("UPDATE experiments SET settings = ? WHERE id = ?",
                        (json.dumps(settings), exp_id))  # fmt: skip
