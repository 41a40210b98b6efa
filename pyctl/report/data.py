"""What a report shows of one experiment, read from the evidence store.

The experiment tables are the experiment runner's (issue 14: experiments,
experiment_steps, load_windows, probe_samples, hypothesis_results,
judgements, expectations, remediations); faults, Xids and anchors are the
store's. A table that is absent (an older database, no Xid monitor) reads
as empty. Times are Unix seconds; an Xid carries only the kernel's
monotonic ts_ns, placed on the wall clock through its fault (or another
fault of its run): wall = fault.wall + (xid.ts_ns - fault.ts_ns) / 1e9.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pyctl.evidence import query
from pyctl.exceptions import BadInput
from pyctl.observe.names import short_function

MAX_CHAINS = 50
# The steady state's streamed and throughput terms the report draws.
TOKEN_TERMS = (
    "ttft_p50", "ttft_p95", "ttft_p99", "itl_p50", "itl_p95", "itl_p99",
    "min_throughput", "output_tokens_per_s",
)  # fmt: skip  # evidence chains shown in full per experiment; the rest are counted


class ReportError(BadInput):
    """One line for the user (exit 2)."""


def _rows(db: Any, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    cur = db.conn.execute(sql, params)
    cols = [c[0] for c in cur.description]
    return [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]


@dataclass
class Marker:
    """A point on the timeline: a fault, an Xid or an anchor."""

    kind: str  # fault | xid | anchor
    at: float
    label: str
    title: str
    fault_id: str | None = None


@dataclass
class ExperimentData:
    exp: dict[str, Any]
    steps: list[dict[str, Any]]
    windows: list[dict[str, Any]]
    hypothesis: list[dict[str, Any]]
    judgements: list[dict[str, Any]]
    expectations: dict[str, dict[str, Any]]
    remediations: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    chains: list[dict[str, Any]]
    markers: list[Marker] = field(default_factory=list)
    chains_left_out: int = 0
    # probe name -> [(at, ok)], in time order (probe_samples)
    probes: dict[str, list[tuple[float, bool | None]]] = field(default_factory=dict)
    # A burn-rate SLO's alert pairs at each window's end (slo_burns, schema 8)
    slo_burns: list[dict[str, Any]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return str(self.exp["id"])

    @property
    def name(self) -> str:
        return str(self.exp.get("name") or self.exp["id"])

    @property
    def t0(self) -> float:
        ts = [self.exp.get("started_at")] + [w["start"] for w in self.windows]
        return float(min(t for t in ts if t is not None))

    @property
    def t1(self) -> float:
        raw = [self.exp.get("ended_at")] + [w["end"] for w in self.windows]
        raw += [s.get("ended_at") for s in self.steps]
        ts = [float(t) for t in raw if t is not None]
        return max(ts) if ts else self.t0 + 1.0

    def step_window(self, st: dict[str, Any]) -> tuple[float, float] | None:
        """A step's real window, else its planned one, else None."""
        s0 = st.get("started_at") if st.get("started_at") is not None else st.get("planned_start")
        if s0 is None:
            return None
        s1 = st.get("ended_at")
        if s1 is None:
            s1 = s0 + (st.get("planned_duration") or 0.0)
        return float(s0), float(max(s1, s0))

    @property
    def faults_ended(self) -> float | None:
        ends = [w[1] for st in self.steps if (w := self.step_window(st))]
        return max(ends) if ends else None

    def recovery_s(self) -> float | None:
        e = self.expectations.get("recovered_within")
        return None if e is None or e.get("value") is None else float(e["value"])

    def overrides(self) -> dict[str, Any]:
        """The knobs this run set away from the experiment's defaults
        (`--set`), read from the same name and version found here; two runs
        of one experiment are told apart by them. {} when it is not found."""
        try:
            knobs = json.loads(self.exp.get("settings") or "{}").get("knobs") or {}
        except (ValueError, AttributeError):
            return {}
        # lazy: pyctl.experiment.load (+68 modules, ~300 ms) only when this runs
        from pyctl.experiment import load as files

        try:
            e = files.load(f"{self.name}@v{self.exp.get('version')}")
        except files.ExperimentError:
            return {}
        return {
            k: v for k, v in knobs.items() if k in e.knobs and str(v) != str(e.knobs[k].default)
        }

    def slo_bounds(self) -> dict[str, float]:
        """The steady state's per-window bounds as the file gave them
        (`p99 = "<= 250ms"`, `error_rate = "<= 1%"`): seconds for the
        latencies, a fraction for the error rate; {} when none was set."""
        try:
            steady = json.loads(self.exp.get("settings") or "{}")["file"]["steady_state"]
        except (ValueError, KeyError, TypeError):
            return {}
        out: dict[str, float] = {}
        for k in ("p50", "p95", "p99", "error_rate"):
            v = steady.get(k) if isinstance(steady, dict) else None
            m = re.fullmatch(r"\s*<=?\s*(\d+(?:\.\d+)?)\s*(ms|s|%)?\s*", str(v)) if v else None
            if m:
                unit = m.group(2) or ("%" if k == "error_rate" else "s")
                out[k] = float(m.group(1)) * {"ms": 0.001, "s": 1.0, "%": 0.01}[unit]
        return out

    def token_bounds(self) -> dict[str, tuple[str, float]]:
        """The streamed and throughput bounds of the steady state, as
        (direction, value): ("<=", seconds) for ttft_*/itl_*, (">=", per
        second) for min_throughput and output_tokens_per_s; {} when none."""
        try:
            steady = json.loads(self.exp.get("settings") or "{}")["file"]["steady_state"]
        except (ValueError, KeyError, TypeError):
            return {}
        if not isinstance(steady, dict):
            return {}
        out: dict[str, tuple[str, float]] = {}
        for k in TOKEN_TERMS:
            v = steady.get(k)
            m = re.fullmatch(r"\s*([<>]=?)\s*(\d+(?:\.\d+)?)\s*(ms|s)?\s*", str(v)) if v else None
            if not m:
                continue
            scale = {"ms": 0.001, "s": 1.0, None: 1.0}[m.group(3)]
            out[k] = (m.group(1)[0] + "=", float(m.group(2)) * scale)
        return out

    def token_breaches(self, w: dict[str, Any]) -> list[str]:
        """The streamed/throughput bounds one window broke."""
        out = []
        for k, (op, bound) in self.token_bounds().items():
            col = "throughput" if k == "min_throughput" else k
            v = w.get(col)
            if v is None or (v <= bound if op == "<=" else v >= bound):
                continue
            if k.startswith(("ttft", "itl")):
                out.append(f"{k} {1000 * v:.0f} ms > {1000 * bound:g} ms")
            else:
                out.append(f"{col} {v:.3g}/s < {bound:g}/s")
        return out

    def burn_summary(self) -> list[dict[str, Any]]:
        """Per burn-rate SLO and alert pair: worst burns, the first firing."""
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for b in self.slo_burns:
            k = (b["slo_id"], b["alert"])
            r = out.setdefault(k, {"slo_id": k[0], "alert": k[1], "factor": b.get("factor"),
                                   "long": 0.0, "short": 0.0, "fired_at": None,
                                   "fired_phase": None, "firing_windows": 0})  # fmt: skip
            r["long"] = max(r["long"], b.get("long_burn") or 0.0)
            r["short"] = max(r["short"], b.get("short_burn") or 0.0)
            if b.get("firing"):
                r["firing_windows"] += 1
                if r["fired_at"] is None:
                    r["fired_at"], r["fired_phase"] = b["at"], b.get("phase")
        return list(out.values())

    def breaches(self, w: dict[str, Any]) -> list[str]:
        """The bounds one load window broke ("p99 412 ms > 250 ms", ...)."""
        out = []
        for k, bound in self.slo_bounds().items():
            v = w.get(k)
            if v is None or v <= bound:
                continue
            if k == "error_rate":
                out.append(f"errors {100 * v:.1f} % > {100 * bound:g} %")
            else:
                out.append(f"{k} {1000 * v:.0f} ms > {1000 * bound:g} ms")
        return out

    def first_armed(self) -> float | None:
        """When the first step was armed (its real start): the fault phase
        begins there, not at the method's planned start."""
        ts = [float(st["started_at"]) for st in self.steps if st.get("started_at") is not None]
        return min(ts) if ts else None

    def recovery_limit_s(self) -> float | None:
        """N of `recovered within N s`: from the settings the runner stored,
        else read out of the expectation's detail ('limit 30 s')."""
        try:
            settings = json.loads(self.exp.get("settings") or "{}")
        except ValueError:
            settings = {}
        found = _find_key(settings, "recovered_within")
        if found is not None:
            return found
        e = self.expectations.get("recovered_within") or {}
        m = re.search(
            r"(?:limit|within|want <=)\D{0,3}(\d+(?:\.\d+)?)\s*s\b", e.get("detail") or ""
        )
        return float(m.group(1)) if m else None


def _find_key(d: Any, stem: str) -> float | None:
    """The first number under a key starting with stem, anywhere in d; a
    duration string ('30s', '2m') is read too."""
    if isinstance(d, dict):
        for k, v in d.items():
            if str(k).startswith(stem):
                # `recovered_within = "30s"` or `[expect.recovered_within] within = "30s"`
                n = _number(v.get("within")) if isinstance(v, dict) else _number(v)
                if n is not None:
                    return n
            n = _find_key(v, stem)
            if n is not None:
                return n
    elif isinstance(d, list):
        for v in d:
            n = _find_key(v, stem)
            if n is not None:
                return n
    return None


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*", v)
        if m:
            return float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    return None


def load(db: Any, experiment_id: str) -> ExperimentData:
    # store.open_db gives every table of the current schema (an older file
    # is overlaid), so only rows can be missing, never a table.
    if not db.conn.execute("SELECT 1 FROM experiments LIMIT 1").fetchone():
        raise ReportError(
            "this database holds no experiments: run `gpufault experiment run` "
            "first, or pass its --db"
        )
    exps = _rows(db, "SELECT * FROM experiments WHERE id = ?", (experiment_id,))
    if not exps:
        raise ReportError(
            f"experiment {experiment_id}: not in this database; "
            "`gpufault experiment list` shows the recorded ones"
        )
    eid = (experiment_id,)
    steps = _rows(
        db,
        "SELECT * FROM experiment_steps WHERE experiment_id = ? ORDER BY idx",
        eid,
    )
    windows = _rows(db, "SELECT * FROM load_windows WHERE experiment_id = ? ORDER BY start", eid)
    hyp = _rows(
        db,
        "SELECT * FROM hypothesis_results WHERE experiment_id = ? ORDER BY rowid",
        eid,
    )
    judg = _rows(db, "SELECT * FROM judgements WHERE experiment_id = ? ORDER BY rowid", eid)
    expect = {
        r["name"]: r
        for r in _rows(
            db,
            "SELECT * FROM expectations WHERE experiment_id = ? ORDER BY rowid",
            eid,
        )
    }
    rem = _rows(
        db,
        "SELECT * FROM remediations WHERE experiment_id = ? ORDER BY started_at",
        eid,
    )
    run_ids = [s["run_id"] for s in steps if s.get("run_id")]
    faults: list[dict[str, Any]] = []
    for rid in dict.fromkeys(run_ids):
        faults += _rows(db, "SELECT * FROM faults WHERE run_id = ? ORDER BY seq", (rid,))
    faults.sort(key=lambda f: (f.get("wall") or 0, f.get("seq") or 0))
    chains = []
    for f in faults[:MAX_CHAINS]:
        doc = query.fault_chain(db, f["fault_id"])
        if doc is not None:
            chains.append(doc)
    d = ExperimentData(
        exps[0],
        steps,
        windows,
        hyp,
        judg,
        expect,
        rem,
        faults,
        chains,
        chains_left_out=max(0, len(faults) - MAX_CHAINS),
    )
    for r in _rows(
        db,
        "SELECT probe, at, ok FROM probe_samples WHERE experiment_id = ? ORDER BY at",
        eid,
    ):
        if r.get("at") is not None:
            ok = None if r.get("ok") is None else bool(r["ok"])
            d.probes.setdefault(str(r["probe"]), []).append((float(r["at"]), ok))
    d.slo_burns = _rows(
        db, "SELECT * FROM slo_burns WHERE experiment_id = ? ORDER BY slo_id, alert, at", eid
    )
    d.markers = _markers(db, d, run_ids)
    return d


def _markers(db: Any, d: ExperimentData, run_ids: list[str]) -> list[Marker]:
    out: list[Marker] = []
    by_id = {f["fault_id"]: f for f in d.faults}
    first_of_run: dict[str, dict[str, Any]] = {}
    for f in d.faults:
        if f.get("wall") is None:
            continue
        first_of_run.setdefault(f["run_id"], f)
        seq = f.get("seq")
        out.append(
            Marker(
                "fault",
                float(f["wall"]),
                f"#{seq}" if seq is not None else f["fault_id"],
                f"fault {f['fault_id']}: {short_function(str(f.get('function')))} "
                f"{f.get('action')} on tid {f.get('tid')}"
                + (f" ({f['comm']})" if f.get("comm") else ""),
                f["fault_id"],
            )
        )
    if run_ids:
        qs = ",".join("?" for _ in run_ids)
        fids = list(by_id)
        fq = ",".join("?" for _ in fids) or "NULL"
        xids = _rows(
            db,
            f"SELECT * FROM xids WHERE run_id IN ({qs}) OR fault_id IN ({fq})",
            (*run_ids, *fids),
        )
        for x in xids:
            ref = by_id.get(x.get("fault_id") or "") or first_of_run.get(x.get("run_id") or "")
            if ref is None or ref.get("ts_ns") is None or x.get("ts_ns") is None:
                continue
            at = float(ref["wall"]) + (x["ts_ns"] - ref["ts_ns"]) / 1e9
            code = x.get("error_code")
            out.append(
                Marker(
                    "xid",
                    at,
                    f"Xid {code}",
                    f"Xid {code} on {x.get('dev')}: {x.get('msg')} "
                    f"(fault {x.get('fault_id') or 'unattributed'}, rule {x.get('rule')})",
                    x.get("fault_id"),
                )
            )
    if by_id:
        fids = list(by_id)
        qs = ",".join("?" for _ in fids)
        for a in _rows(
            db,
            f"SELECT fault_id, kind, bdf, wall_ns, rec_seq FROM anchors "
            f"WHERE fault_id IN ({qs}) ORDER BY wall_ns",
            tuple(fids),
        ):
            if not a.get("wall_ns"):
                continue
            out.append(
                Marker(
                    "anchor",
                    a["wall_ns"] / 1e9,
                    f"anchor {a.get('kind')}",
                    f"anchor {a.get('kind')} on {a.get('bdf')} (fault {a['fault_id']}, "
                    f"record {a.get('rec_seq')})",
                    a["fault_id"],
                )
            )
    out.sort(key=lambda m: m.at)
    return out
