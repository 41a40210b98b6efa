"""The hooks' evidence: runs and faults rows in the gpufault store.

- VRAM pressure (`hooks vram-pressure`): the hold is one fault (action
  `pressure`, function `vram-hold`): share, bytes asked for and held,
  the memory readings before/after, start and end (wall, latency_ns).
  Written when the child says it holds (an open window: latency_ns NULL
  until it releases), completed at its release line.
- Tensor Core bit flips (`hooks tc-measure`): one fault per flipped
  (bit spec, layer): function the layer's name, outcome bits, rate,
  dtype, calls, elements and bits flipped, the divergence of that row.
- The LD_PRELOAD shim (`hooks preload`, `hooks preload-import`): one
  fault per JSON line of its log (action `fail`, function the CUDA entry
  point, retval/ret the code it returned, call_seq its call number).

The store is opened only once something happened (the hold began, the
program ran): a refused start leaves no database and no run behind.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pyctl.evidence import layers, store


def open_store(db_path: str | Path) -> Any:
    return store.open_db(db_path)


class VramRun:
    """Turns vram_pressure's two JSON lines into a run and its fault."""

    def __init__(self, db_path: str | Path, argv: Sequence[str], spec: dict[str, Any]) -> None:
        self.db_path, self.argv, self.spec = db_path, list(argv), spec
        self.db: Any = None
        self.run_id = ""
        self.row: dict[str, Any] = {}
        self.outcome: dict[str, Any] = {}
        self.released = False

    def event(self, rec: dict[str, Any]) -> None:
        if rec.get("event") == "holding":
            self._holding(rec)
        elif rec.get("event") == "released" and self.db is not None:
            self._released(rec)

    def _holding(self, rec: dict[str, Any]) -> None:
        self.db = open_store(self.db_path)
        self.run_id = store.new_run(
            self.db, self.argv, "hooks:vram-pressure", mechanism="vram-hold"
        )
        text = (
            f"vram-pressure share={self.spec['share']} duration={self.spec['duration']}s "
            f"device={self.spec['device']} allocator={rec.get('allocator')}"
        )
        layers.add_spec(self.db, self.run_id, 0, text, self.spec)
        # The readings come from NVML, except with the test double.
        readings = "test double" if rec.get("allocator") == "host-double" else "nvml"
        self.outcome = {k: v for k, v in rec.items() if k not in ("event", "pid")}
        self.outcome["readings"] = readings
        self.row = layers.fault_row(
            self.run_id,
            1,
            action="pressure",
            function="vram-hold",
            library=f"device {rec.get('device', self.spec['device'])}",
            mechanism="vram-hold",
            outcome=self.outcome,
            pid=rec.get("pid"),
            tid=rec.get("pid"),
            comm="vram_pressure",
            call_seq=1,
            ret=rec.get("bytes_held"),
        )
        layers.insert_faults(self.db, [self.row])

    def _released(self, rec: dict[str, Any]) -> None:
        self.released = True
        self.outcome.update({k: v for k, v in rec.items() if k not in ("event", "pid", "device")})
        self.row["outcome"] = json.dumps(self.outcome, sort_keys=True, default=str)
        self.row["latency_ns"] = int(rec.get("held_s", 0) * 1e9)
        # held_s counts from before the allocation (the child's start of the
        # hold), earlier than the holding line reached us.
        self.row["wall"] = time.time() - rec.get("held_s", 0)
        layers.insert_faults(self.db, [self.row])

    def end(self, exit_code: int) -> str | None:
        """Close the run (if the hold began); its ID."""
        if self.db is None:
            return None
        status = "done" if self.released and exit_code == 0 else "failed"
        store.end_run(
            self.db,
            self.run_id,
            status,
            exit_code,
            {"bytes_held": self.outcome.get("bytes_held"), "released": self.released},
        )
        self.db.close()
        return self.run_id


def record_tc(
    db_path: str | Path, argv: Sequence[str], spec: dict[str, Any], events: Iterable[dict[str, Any]]
) -> tuple[str, int]:
    """tc_measure's per-layer counts as one run; (run_id, faults)."""
    rows = [e for e in events if e.get("bits_flipped")]
    db = open_store(db_path)
    try:
        run_id = store.new_run(db, argv, "hooks:tc-measure", mechanism="torch-hook")
        text = " ".join(f"{k}={v}" for k, v in sorted(spec.items()) if v is not None)
        layers.add_spec(db, run_id, 0, f"tc-measure {text}", spec)
        faults = [
            layers.fault_row(
                run_id,
                seq,
                action="bitflip",
                function=e["layer"],
                library="tiny_model",
                mechanism="torch-hook",
                outcome={k: v for k, v in e.items() if k not in ("layer", "pid")},
                pid=e.get("pid"),
                tid=e.get("pid"),
                comm="tc_measure",
                call_seq=seq,
            )
            for seq, e in enumerate(rows, 1)
        ]
        layers.insert_faults(db, faults)
        store.end_run(db, run_id, "done", 0, {"faults": len(faults)})
    finally:
        db.close()
    return run_id, len(faults)


def preload_rows(run_id: str, lines: Iterable[str], rules: str) -> list[dict[str, Any]]:
    """The shim's log lines as faults rows (a torn or foreign line is skipped)."""
    out: list[dict[str, Any]] = []
    now = time.time()
    for line in lines:
        try:
            e = json.loads(line)
            func, ret = str(e["func"]), int(e["ret"])
        except (ValueError, KeyError, TypeError):
            continue
        out.append(
            layers.fault_row(
                run_id,
                len(out) + 1,
                action="fail",
                function=func,
                library="libcuda.so.1",
                mechanism="ld-preload",
                outcome={
                    "via": e.get("via"),
                    "fire": e.get("fire"),
                    "rules": rules,
                    "returned": ret,
                },
                pid=e.get("pid"),
                tid=e.get("tid"),
                comm="",
                ts_ns=e.get("ts_ns"),
                wall=now,
                call_seq=e.get("call"),
                retval=ret,
                ret=ret,
            )
        )
    return out


def import_preload(
    db_path: str | Path,
    argv: Sequence[str],
    log: Path,
    rules: str,
    *,
    exit_code: int | None = None,
    started: float | None = None,
) -> tuple[str, int]:
    """One run holding every fire of the shim's log; (run_id, faults)."""
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    db = open_store(db_path)
    try:
        run_id = store.new_run(db, argv, "hooks:preload", mechanism="ld-preload")
        if started is not None:
            with db.conn:
                db.conn.execute("UPDATE runs SET started=? WHERE run_id=?", (started, run_id))
        layers.add_spec(db, run_id, 0, f"preload {rules}", {"rules": rules, "log": str(log)})
        rows = preload_rows(run_id, text, rules)
        layers.insert_faults(db, rows)
        store.end_run(db, run_id, "done", exit_code, {"faults": len(rows), "lines": len(text)})
    finally:
        db.close()
    return run_id, len(rows)
