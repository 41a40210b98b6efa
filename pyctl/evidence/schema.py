"""Every table of the evidence store, one SCHEMA_VERSION, and migrations.

The stores (pyctl/evidence/store.py, xid.py, evidence/anchors.py, tokenizer/record.py,
experiment/evidence.py) write and read these tables; none defines one.
ensure_schema() brings any database up to SCHEMA_VERSION: the migrations
from its PRAGMA user_version, then every table and index that is missing.
A reader that may not write (`faults`, `show`: mode=ro) gets overlay()
instead: empty TEMP stand-ins for what an older file lacks, so queries
never ask whether a table exists.

Foreign keys are declared (PRAGMA foreign_key_check and readers see how
rows refer to each other) but not enforced (PRAGMA foreign_keys stays
off): a fault's rows come from two rings read in their own order (a call
row may land before its fault row), and ingest must never fail a batch
over the order rows arrive in.

Adding a table: one Table in TABLES (and its lines in docs/schema.md; the
test says what is missing). Changing an existing table: bump
SCHEMA_VERSION and add the migration from the previous version.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pyctl.bpf import abi

# 1: pyctl/evidence/store.py's ensure_schema (runs ... calls), with xids, anchors
#    and tok_cases created by their own stores as they were first written.
#    One version number covered two layouts: stacks gained module and
#    offset (788dee5) without a bump.
# 2: one schema for every table, foreign keys declared, the experiment
#    tables, calls' columns in the call record's order.
# 3: stacks' build_id, method (ip, cfi, fp, caller: how the frame was
#    found) and stop (on a fault's last frame: why the walk ended).
# 4: funcs' aliases (a probe site's other names; symbol is the canonical one).
# 5: pyframes (a CPython thread's Python stack at the fire).
# 6: targets (who a run's target process is: host and container pids,
#    namespaces, cgroup, container, pod, rank, the selector that chose it).
# 7: explorations, explore_points, explore_trials; targets.root.
# 8: load_windows' streamed terms (TTFT/ITL percentiles, output tokens/s,
#    goodput), hypothesis_results.slo_id and judgements.slo_id, the
#    burn-rate SLO tables slo_windows and slo_burns, and
#    experiment_steps.thread_name (the target's name of the step's thread).
SCHEMA_VERSION = 8


class SchemaError(Exception):
    """A database this gpufault cannot bring to its schema (one line)."""


@dataclass(frozen=True)
class Table:
    """One table: columns as "name TYPE [NOT NULL]", the primary key, the
    foreign keys as (columns, table, columns) and indexes as (name, columns)."""

    name: str
    columns: tuple[str, ...]
    pk: tuple[str, ...] = ()
    fks: tuple[tuple[tuple[str, ...], str, tuple[str, ...]], ...] = ()
    indexes: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def column_names(self) -> list[str]:
        return [c.split()[0] for c in self.columns]

    def create_sql(self, name: str | None = None, *, temp: bool = False) -> str:
        """CREATE TABLE, under another name for a rebuild; a TEMP stand-in
        has no keys (nothing is written to it)."""
        parts = []
        single = len(self.pk) == 1
        for c in self.columns:
            col, rest = c.split(maxsplit=1)
            key = " PRIMARY KEY" if single and not temp and col == self.pk[0] else ""
            parts.append(f"{_q(col)} {rest}{key}")
        if not temp:
            if len(self.pk) > 1:
                parts.append(f"PRIMARY KEY ({_qs(self.pk)})")
            for cols, table, refs in self.fks:
                parts.append(f"FOREIGN KEY ({_qs(cols)}) REFERENCES {_q(table)} ({_qs(refs)})")
        where = "TEMP TABLE" if temp else "TABLE"
        return f"CREATE {where} IF NOT EXISTS {_q(name or self.name)} ({', '.join(parts)})"

    def index_sql(self) -> list[str]:
        return [
            f"CREATE INDEX IF NOT EXISTS {_q(n)} ON {_q(self.name)} ({_qs(cols)})"
            for n, cols in self.indexes
        ]


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _qs(names: Iterable[str]) -> str:
    return ", ".join(_q(n) for n in names)


def _run(col: str = "run_id") -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    return ((col,), "runs", ("run_id",))


def _fault(col: str = "fault_id") -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    return ((col,), "faults", ("fault_id",))


def _experiment() -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    return (("experiment_id",), "experiments", ("id",))


# ---- calls: derived from the call record (abi.CALL_FIELDS) --------------------

# Record scalars that become something other than a same-named INTEGER
# column: (column definition, SQL over the record's scalars), or nothing.
_CALL_DERIVED: dict[str, tuple[tuple[str, str], ...]] = {
    "ring_len": (),
    "ring_pgoff": (),
    "size": (),
    "cookie": (("spec INTEGER", "{cookie} >> 32"), ("func INTEGER", "{cookie} & 4294967295")),
    "fault_seq": (
        ("fault_id TEXT", "CASE WHEN {fault_seq} != 0 THEN '{run}-' || {fault_seq} END"),
    ),
}


def _call_columns() -> tuple[tuple[str, str], ...]:
    """(column definition, SQL expression) of every calls column but run_id,
    in the record's order; {name} in the SQL is that scalar's binding."""
    out: list[tuple[str, str]] = []
    for name in abi.CALL_SCALARS:
        out.extend(_CALL_DERIVED.get(name, ((f"{name} INTEGER", f"{{{name}}}"),)))
    return tuple(out)


CALL_COLUMNS = _call_columns()


def call_insert_sql(rows: int = 1) -> str:
    """The calls insert for raw ring records, with {run} left for the run id.

    Ring records go straight from struct.iter_unpack to SQLite with no
    Python per row: each record binds, in order, to the plain `?`s of one
    row of a VALUES table (one per abi.CALL_SCALARS, columnN in SQLite's
    naming), and the outer SELECT computes the columns. Not numbered
    parameters (?3, ?5 ...) with a sequence: Python 3.12 warns per binding
    and row (10x slower: 23k rows/s on the H200 machine) and 3.14 refuses
    them.

    rows > 1: one statement inserts that many records, bound as one flat
    sequence of rows * len(CALL_SCALARS) values (store.insert_call_records).
    Per statement SQLite and the sqlite3 module pay a reset, a step's
    set-up and a commit of the statement journal; per row only the binds
    and the B-tree inserts. 48 rows a statement stored 2.4-3x the rows/s
    of one (bench/bench_sustained.py, docs/benchmarks.md).
    """
    n = len(abi.CALL_SCALARS)
    col = {name: f"column{i + 1}" for i, name in enumerate(abi.CALL_SCALARS)}
    cols = ", ".join(["run_id", *(c.split()[0] for c, _ in CALL_COLUMNS)])
    exprs = ", ".join(["'{run}'", *(sql.format(run="{run}", **col) for _, sql in CALL_COLUMNS)])
    one = "(" + ", ".join("?" * n) + ")"
    # Braces of the run id survive format() above; the caller fills them.
    return f"INSERT INTO calls ({cols}) SELECT {exprs} FROM (VALUES {', '.join([one] * rows)})"


# ---- the tables ------------------------------------------------------------

TABLES: tuple[Table, ...] = (
    Table(
        "runs",
        (
            "run_id TEXT",
            "argv TEXT",
            "kind TEXT",
            "kernel TEXT",
            "host TEXT",
            "mechanism TEXT",
            "capabilities TEXT",
            "started REAL",
            "ended REAL",
            "status TEXT",
            "exit_code INTEGER",
            "stats TEXT",
        ),
        pk=("run_id",),
    ),
    Table(
        "specs",
        ("run_id TEXT", "spec INTEGER", "text TEXT", "json TEXT"),
        pk=("run_id", "spec"),
        fks=(_run(),),
    ),
    Table(
        "funcs",
        (
            "run_id TEXT",
            "func INTEGER",
            "library TEXT",
            "build_id TEXT",
            "symbol TEXT",
            "offset INTEGER",
            "address INTEGER",
            "first_insn TEXT",
            "aliases TEXT",
        ),
        pk=("run_id", "func"),
        fks=(_run(),),
    ),
    Table(
        "faults",
        (
            "fault_id TEXT",
            "run_id TEXT",
            "seq INTEGER",
            "spec INTEGER",
            "func INTEGER",
            "function TEXT",
            "library TEXT",
            "build_id TEXT",
            "action TEXT",
            "mechanism TEXT",
            "retval INTEGER",
            "call_seq INTEGER",
            "pid INTEGER",
            "tid INTEGER",
            "comm TEXT",
            "ts_ns INTEGER",
            "wall REAL",
            "ret INTEGER",
            "latency_ns INTEGER",
            "outcome TEXT",
        ),
        pk=("fault_id",),
        fks=(
            _run(),
            (("run_id", "spec"), "specs", ("run_id", "spec")),
            (("run_id", "func"), "funcs", ("run_id", "func")),
        ),
        indexes=(("faults_run", ("run_id",)),),
    ),
    Table(
        "fire_journal",
        ("run_id TEXT", "batch INTEGER", "n INTEGER", "records BLOB"),
        pk=("run_id", "batch"),
        fks=(_run(),),
    ),
    Table(
        "registers",
        ("fault_id TEXT", "reg TEXT", "value INTEGER"),
        pk=("fault_id", "reg"),
        fks=(_fault(),),
    ),
    Table(
        "args",
        ("fault_id TEXT", "idx INTEGER", "name TEXT", "raw INTEGER", "decoded TEXT"),
        pk=("fault_id", "idx"),
        fks=(_fault(),),
    ),
    Table(
        "stacks",
        (
            "fault_id TEXT",
            "depth INTEGER",
            "address INTEGER",
            "symbol TEXT",
            "module TEXT",
            "offset INTEGER",
            "build_id TEXT",
            "method TEXT",
            "stop TEXT",
        ),
        pk=("fault_id", "depth"),
        fks=(_fault(),),
    ),
    Table(
        "targets",
        (
            "run_id TEXT",
            "host_pid INTEGER",
            "host_tid INTEGER",
            "ns_pid INTEGER",
            "ns_tid INTEGER",
            "ns_depth INTEGER",
            "pid_ns INTEGER",
            "mnt_ns INTEGER",
            "comm TEXT",
            "cgroup TEXT",
            "container_id TEXT",
            "container_name TEXT",
            "runtime TEXT",
            "pod_namespace TEXT",
            "pod_name TEXT",
            "pod_uid TEXT",
            "rank INTEGER",
            "selector TEXT",
            "root TEXT",
        ),
        pk=("run_id",),
        fks=(_run(),),
    ),
    Table(
        "pyframes",
        (
            "fault_id TEXT",
            "depth INTEGER",
            "function TEXT",
            "file TEXT",
            "line INTEGER",
            "entry INTEGER",
        ),
        pk=("fault_id", "depth"),
        fks=(_fault(),),
    ),
    Table(
        "links",
        (
            "id INTEGER",
            "fault_id TEXT",
            "run_id TEXT",
            "kind TEXT",
            "rule TEXT",
            "ts_ns INTEGER",
            "pid INTEGER",
            "tid INTEGER",
            "detail TEXT",
        ),
        pk=("id",),
        fks=(_fault(), _run()),
        indexes=(("links_fault", ("fault_id",)),),
    ),
    Table(
        "calls",
        ("run_id TEXT", *(c for c, _ in CALL_COLUMNS)),
        fks=(_run(), _fault()),
        indexes=(("calls_run", ("run_id", "func")),),
    ),
    Table(
        "xids",
        (
            "id INTEGER",
            "fault_id TEXT",
            "run_id TEXT",
            "dev TEXT",
            "error_code INTEGER",
            "msg TEXT",
            "ts_ns INTEGER",
            "pid INTEGER",
            "tid INTEGER",
            "rule TEXT",
        ),
        pk=("id",),
        fks=(_fault(), _run()),
    ),
    # The kernel module's records: fault_id is the module's text (a
    # gpufault fault ID, or "kmod-N" for its own), run_id its integer run:
    # neither refers to a row here, so no foreign keys.
    Table(
        "anchors",
        (
            "id INTEGER",
            "fault_id TEXT NOT NULL",
            "kind TEXT NOT NULL",
            "run_id INTEGER",
            "fault_seq INTEGER",
            "from_context INTEGER",
            "rec_seq INTEGER",
            "mono_ns INTEGER",
            "wall_ns INTEGER",
            "bdf TEXT",
            "vendor INTEGER",
            "device INTEGER",
            "code INTEGER",
            "pid INTEGER",
            "ctx_pid INTEGER",
            "comm TEXT",
            "config_ok INTEGER",
            "config BLOB",
            "devsta INTEGER",
            "aer_pos INTEGER",
            "aer TEXT",
            "bar0 TEXT",
        ),
        pk=("id",),
        indexes=(("idx_anchors_fault_id", ("fault_id",)),),
    ),
    # A tokenizer case's fault_id is its own "<run>-<seq>", not a faults row.
    Table(
        "tok_cases",
        (
            "fault_id TEXT",
            "run_id TEXT",
            "seq INTEGER",
            "campaign TEXT",
            "kind TEXT",
            "input_sha256 TEXT",
            "input_len INTEGER",
            "input_bytes INTEGER",
            "text TEXT",
            "outcome TEXT",
            "error TEXT",
            "latency_ns INTEGER",
            "details TEXT",
        ),
        pk=("fault_id",),
        fks=(_run(),),
        indexes=(("tok_cases_run", ("run_id", "campaign")),),
    ),
    # The experiment tables: the columns of pyctl/experiment/evidence.py's
    # EXPERIMENT_DDL (tests/test_schema.py keeps the two equal), with the
    # foreign keys its rows imply.
    Table(
        "experiments",
        (
            "id TEXT",
            "name TEXT",
            "version INTEGER",
            "file TEXT",
            "slo_id TEXT",
            "started_at REAL",
            "ended_at REAL",
            "verdict TEXT",
            "reason TEXT",
            "settings TEXT",
            "host TEXT",
        ),
        pk=("id",),
    ),
    Table(
        "experiment_steps",
        (
            "experiment_id TEXT",
            "idx INTEGER",
            "name TEXT",
            "template TEXT",
            "spec TEXT",
            "run_id TEXT",
            "planned_start REAL",
            "planned_duration REAL",
            "started_at REAL",
            "ended_at REAL",
            "fires INTEGER",
            "status TEXT",
            "thread_name TEXT",
        ),
        pk=("experiment_id", "idx"),
        fks=(_experiment(), _run()),
        indexes=(("experiment_steps_run", ("run_id",)),),
    ),
    Table(
        "probe_samples",
        (
            "experiment_id TEXT",
            "probe TEXT",
            "phase TEXT",
            "at REAL",
            "ok INTEGER",
            "value REAL",
            "detail TEXT",
        ),
        fks=(_experiment(),),
        indexes=(("probe_samples_exp", ("experiment_id",)),),
    ),
    Table(
        "load_windows",
        (
            "experiment_id TEXT",
            "start REAL",
            "end REAL",
            "count INTEGER",
            "p50 REAL",
            "p95 REAL",
            "p99 REAL",
            "error_rate REAL",
            "throughput REAL",
            "phase TEXT",
            "ttft_p50 REAL",
            "ttft_p95 REAL",
            "ttft_p99 REAL",
            "itl_p50 REAL",
            "itl_p95 REAL",
            "itl_p99 REAL",
            "output_tokens_per_s REAL",
            "goodput REAL",
        ),
        fks=(_experiment(),),
        indexes=(("load_windows_exp", ("experiment_id",)),),
    ),
    # A burn-rate SLO's 1 s windows ([[slo]], pyctl/experiment/burn.py):
    # requests due in [start, end) and how many were good.
    Table(
        "slo_windows",
        (
            "experiment_id TEXT",
            "slo_id TEXT",
            "start REAL",
            "end REAL",
            "phase TEXT",
            "total INTEGER",
            "good INTEGER",
        ),
        fks=(_experiment(),),
        indexes=(("slo_windows_exp", ("experiment_id", "slo_id")),),
    ),
    # Each alert pair of a burn-rate SLO at the end of each window: the
    # long and short windows' burn rates; firing when both exceed factor.
    Table(
        "slo_burns",
        (
            "experiment_id TEXT",
            "slo_id TEXT",
            "alert TEXT",
            "long_s REAL",
            "short_s REAL",
            "factor REAL",
            "at REAL",
            "phase TEXT",
            "long_burn REAL",
            "short_burn REAL",
            "firing INTEGER",
        ),
        fks=(_experiment(),),
        indexes=(("slo_burns_exp", ("experiment_id", "slo_id")),),
    ),
    Table(
        "hypothesis_results",
        (
            "experiment_id TEXT",
            "phase TEXT",
            "probe TEXT",
            "ok INTEGER",
            "value TEXT",
            "tolerance TEXT",
            "detail TEXT",
            "slo_id TEXT",
        ),
        fks=(_experiment(),),
    ),
    Table(
        "judgements",
        (
            "experiment_id TEXT",
            "metric TEXT",
            "baseline_n INTEGER",
            "window_n INTEGER",
            "p_value REAL",
            "effect REAL",
            "worse INTEGER",
            "reason TEXT",
            "slo_id TEXT",
        ),
        fks=(_experiment(),),
    ),
    Table(
        "expectations",
        (
            "experiment_id TEXT",
            "name TEXT",
            "ok INTEGER",
            "value REAL",
            "detail TEXT",
        ),
        fks=(_experiment(),),
    ),
    Table(
        "remediations",
        (
            "experiment_id TEXT",
            "command TEXT",
            "started_at REAL",
            "ended_at REAL",
            "rc INTEGER",
        ),
        fks=(_experiment(),),
    ),
    Table(
        "explorations",
        (
            "id TEXT NOT NULL",
            "file TEXT",
            "target TEXT",
            "started_at REAL",
            "ended_at REAL",
            "status TEXT",
            "settings TEXT",
            "discover_experiment TEXT",
            "points INTEGER",
            "calls INTEGER",
            "host TEXT",
        ),
        pk=("id",),
    ),
    Table(
        "explore_points",
        (
            "exploration_id TEXT NOT NULL",
            "point TEXT NOT NULL",
            "library TEXT",
            "function TEXT",
            "site TEXT",
            "signature TEXT",
            "stack TEXT",
            "calls INTEGER",
            "rate REAL",
            "codes TEXT",
            "example_fault TEXT",
        ),
        pk=("exploration_id", "point"),
        fks=((("exploration_id",), "explorations", ("id",)),),
    ),
    Table(
        "explore_trials",
        (
            "exploration_id TEXT NOT NULL",
            "idx INTEGER NOT NULL",
            "point TEXT",
            "action TEXT",
            "code TEXT",
            "status TEXT",
            "outcome TEXT",
            "reason TEXT",
            "experiment_id TEXT",
            "fires INTEGER",
            "recover_s REAL",
            "file TEXT",
            "reproduce TEXT",
            "started_at REAL",
            "ended_at REAL",
        ),
        pk=("exploration_id", "idx"),
        fks=(
            (("exploration_id",), "explorations", ("id",)),
            (("experiment_id",), "experiments", ("id",)),
        ),
    ),
)

BY_NAME: dict[str, Table] = {t.name: t for t in TABLES}


# ---- views: the friendly forms (hex addresses, names, UTC times) ---------------
# For sqlite3 and Datasette users (pyctl/evidence/datasette.json describes
# them); gpufault's own readers use the tables. Derived data only: a view
# that is missing or whose SQL changed (a catalog gained codes) is created
# again by ensure_schema, or shadowed by a TEMP view for a read-only reader,
# with no SCHEMA_VERSION bump. Documented in docs/schema.md ("# Views").


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _code_case(col: str, lib_col: str = "library") -> str:
    """CASE naming `col` from the catalog of the library `lib_col` is
    (CUDA_ERROR_OUT_OF_MEMORY): the same tables `show` names codes from."""
    try:
        # lazy: the catalog is optional: without it the views show numbers only
        from pyctl import catalog
        from pyctl.catalog.registry import LIBRARIES
    except Exception:  # noqa: BLE001 - no catalog: numbers only
        return "NULL"
    arms = []
    for lib in LIBRARIES:
        codes = catalog.codes(lib) or {}
        if not codes:
            continue
        whens = " ".join(f"WHEN {int(v)} THEN {_lit(n)}" for v, n in sorted(codes.items()))
        globs = " OR ".join(f"{lib_col} GLOB {_lit('*' + g)}" for g in catalog.lib_globs(lib))
        arms.append(f"WHEN {globs} THEN CASE {col} {whens} END")
    return f"CASE {' '.join(arms)} END" if arms else "NULL"


def _signal_case(col: str) -> str:
    # lazy: signal (+1 module) only when this runs
    import signal as _signal

    whens = " ".join(
        f"WHEN {int(s)} THEN {_lit(s.name)}"
        for s in sorted(_signal.Signals, key=int)
        if not s.name.startswith("SIGRT")
    )
    return f"CASE {col} {whens} ELSE 'signal ' || {col} END"


def _utc(col: str) -> str:
    return f"strftime('%Y-%m-%d %H:%M:%f', {col}, 'unixepoch')"


def _hex(col: str, width: int = 0) -> str:
    # printf's %x reads a negative 64-bit integer as its unsigned value.
    fmt = f"0x%0{width}x" if width else "0x%x"
    return f"CASE WHEN {col} IS NOT NULL THEN printf('{fmt}', {col}) END"


def _views() -> dict[str, str]:
    detail = "json_extract(l.detail, '$.{}')".format
    return {
        "faults_readable": (
            "SELECT f.fault_id, f.run_id, " + _utc("f.wall") + " AS time_utc, f.function, "
            "f.library, f.action, f.mechanism, f.retval, "
            + _code_case("f.retval", "f.library")
            + " AS retval_name, f.ret, "
            + _code_case("f.ret", "f.library")
            + " AS ret_name, f.latency_ns / 1e6 AS latency_ms, f.call_seq, f.pid, f.tid, "
            "f.comm, CASE json_extract(f.outcome, '$.injected') WHEN 1 THEN 'yes' "
            "WHEN 0 THEN 'no' END AS injected, coalesce(json_extract(f.outcome, "
            "'$.copilot.error'), json_extract(f.outcome, '$.corrupt_error'), "
            "json_extract(f.outcome, '$.error')) AS error, "
            + _hex("json_extract(f.outcome, '$.corrupt_addr')")
            + " AS corrupt_addr, (SELECT count(*) FROM links k WHERE k.fault_id = f.fault_id)"
            " AS links FROM faults f"
        ),
        "stacks_readable": (
            "SELECT s.fault_id, s.depth, " + _hex("s.address", 16) + " AS address, s.symbol, "
            "s.module, " + _hex("s.offset") + " AS offset, s.build_id, s.method, s.stop "
            "FROM stacks s"
        ),
        "registers_readable": (
            "SELECT r.fault_id, r.reg, " + _hex("r.value", 16) + " AS value FROM registers r"
        ),
        "args_readable": (
            "SELECT a.fault_id, a.idx, a.name, " + _hex("a.raw") + " AS raw, a.decoded FROM args a"
        ),
        "links_readable": (
            "SELECT l.id, l.fault_id, l.run_id, l.kind, l.rule, l.ts_ns, l.pid, l.tid, "
            "CASE l.kind WHEN 'signal' THEN "
            + _signal_case(detail("signal"))
            + " || coalesce(': ' || "
            + detail("cause")
            + ", ': ' || "
            + detail("why")
            + ", '') WHEN 'exit' THEN CASE WHEN "
            + detail("term_signal")
            + " > 0 THEN 'killed by ' || "
            + _signal_case(detail("term_signal"))
            + " ELSE 'exited with status ' || "
            + detail("exit_status")
            + " END WHEN 'error-return' THEN coalesce(fn.symbol, 'func ' || "
            + detail("func")
            + ") || ' returned ' || coalesce("
            + _code_case(detail("ret"), "fn.library")
            + ", "
            + detail("ret")
            + ") ELSE l.detail END AS what FROM links l LEFT JOIN funcs fn ON fn.run_id = "
            "l.run_id AND fn.func = " + detail("func")
        ),
        "explore_map": (
            "SELECT t.exploration_id, t.idx, t.point, p.library, p.function, p.site, p.calls, "
            "p.rate, t.action, t.code, t.status, t.outcome, t.recover_s, t.fires, "
            "t.experiment_id, e.verdict, t.reason, t.reproduce FROM explore_trials t "
            "LEFT JOIN explore_points p ON p.exploration_id = t.exploration_id AND "
            "p.point = t.point LEFT JOIN experiments e ON e.id = t.experiment_id"
        ),
    }


VIEW_NAMES = (
    "faults_readable",
    "stacks_readable",
    "registers_readable",
    "args_readable",
    "links_readable",
    "explore_map",
)
# Building the views' SQL imports the catalogs (~0.15 s): too slow for every
# open_db before a trace attaches. A view carries this version in a comment
# instead, and only a missing or older one is built. VIEWS_SHA256 is the
# digest of views(): tests/test_datasette.py says when it changed (a
# catalog gained codes), so that VIEWS_VERSION is bumped with it.
VIEWS_VERSION = 3  # 2: stacks_readable shows build_id, method, stop; 3: explore_map
VIEWS_SHA256 = "9ecc990551ef5cae2f8c5fbdd150bbae7bb6d3fe0f7f7508a8147e33cce37bb5"
_VIEWS: dict[str, str] | None = None


def views() -> dict[str, str]:
    """name -> SELECT of every view (built once: the catalogs' codes).

    A new database needs them before a trace's probes are live, so the
    built text is kept in the disk cache (pyctl/diskcache.py, root's
    alone) under VIEWS_SHA256, which tests/test_datasette.py holds to the
    digest of _views(): a catalog that changes the text changes the key.
    Imports the catalogs only on a miss (~15 ms of a new database's open)."""
    global _VIEWS
    if _VIEWS is None:
        # lazy: pyctl.diskcache (pickle) only when a view is to be built
        from pyctl import diskcache

        key = f"{SCHEMA_VERSION}-{VIEWS_VERSION}-{VIEWS_SHA256}"
        got = diskcache.load_obj("views", key)
        if isinstance(got, dict) and set(got) == set(VIEW_NAMES):
            _VIEWS = got
        else:
            _VIEWS = _views()
            diskcache.store_obj("views", key, _VIEWS)
    return _VIEWS


def view_sql(name: str, *, temp: bool = False) -> str:
    return f"CREATE {'TEMP ' if temp else ''}VIEW {_q(name)} AS /* {_VIEW_MARK} */ {views()[name]}"


_VIEW_MARK = f"gpufault views {VIEWS_VERSION}"


def views_sha256() -> str:
    # lazy: keeps hashlib (+3 modules) off trace's start and `trace --help`
    import hashlib

    # Built here, never from the cache: this digest is what keys the cache.
    return hashlib.sha256(json.dumps(_views(), sort_keys=True).encode()).hexdigest()


def _stale_views(conn: sqlite3.Connection, schema: str = "main") -> list[str]:
    have = dict(
        conn.execute(f"SELECT name, sql FROM {schema}.sqlite_master WHERE type = 'view'").fetchall()
    )
    return [n for n in VIEW_NAMES if _VIEW_MARK not in (have.get(n) or "")]


# The tables pyctl/experiment/evidence.py writes: script(EXPERIMENT_TABLES)
# is the DDL its EXPERIMENT_DDL can become (one definition, here).
EXPERIMENT_TABLES = (
    "experiments",
    "experiment_steps",
    "probe_samples",
    "load_windows",
    "hypothesis_results",
    "judgements",
    "expectations",
    "remediations",
    "slo_windows",
    "slo_burns",
)


def script(names: Iterable[str]) -> str:
    """CREATE TABLE/INDEX IF NOT EXISTS of the named tables, as one script."""
    return "".join(
        f"{s};\n" for n in names for s in (BY_NAME[n].create_sql(), *BY_NAME[n].index_sql())
    )


# ---- inspecting a live database ----------------------------------------------


def _conn(db: Any) -> sqlite3.Connection:
    """A Database (pyctl/evidence/sqlitedb.py) or a plain connection."""
    return db.conn if hasattr(db, "conn") else db


def user_version(db: Any) -> int:
    return int(_conn(db).execute("PRAGMA user_version").fetchone()[0])


def shape(conn: sqlite3.Connection, name: str, schema: str = "main") -> dict[str, Any]:
    """What makes two tables the same here: columns (name, type, not null,
    primary-key position) in order, foreign keys, indexes and their columns."""
    cols = [
        (r[1], r[2].upper(), r[3], r[5])
        for r in conn.execute(f"PRAGMA {schema}.table_info({_q(name)})")
    ]
    fks = sorted(
        (r[2], r[3], r[4], r[1])
        for r in conn.execute(f"PRAGMA {schema}.foreign_key_list({_q(name)})")
    )
    idx = {}
    for r in conn.execute(f"PRAGMA {schema}.index_list({_q(name)})"):
        if r[3] == "c":  # made by CREATE INDEX, not a key's own
            idx[r[1]] = [c[2] for c in conn.execute(f"PRAGMA {schema}.index_info({_q(r[1])})")]
    return {"columns": cols, "fks": fks, "indexes": idx}


def reference() -> sqlite3.Connection:
    """An in-memory database holding exactly the current schema."""
    ref = sqlite3.connect(":memory:")
    for t in TABLES:
        ref.execute(t.create_sql())
        for s in t.index_sql():
            ref.execute(s)
    return ref


def _names(conn: sqlite3.Connection, kind: str, schema: str = "main") -> set[str]:
    return {
        r[0]
        for r in conn.execute(f"SELECT name FROM {schema}.sqlite_master WHERE type = ?", (kind,))
    }


# ---- migrations: MIGRATIONS[v] takes a database from version v to v + 1 --------


def _keeps_every_column(t: Any, old: dict[str, Any]) -> list[str]:
    """The old table's column names, once sure a rebuild to this schema
    drops none of them (the migration and the read-only check both ask)."""
    cols = [c[0] for c in old["columns"]]
    lost = [c for c in cols if c not in t.column_names]
    if lost:
        raise SchemaError(
            f"table {t.name}: columns {', '.join(lost)} are not in "
            f"schema {SCHEMA_VERSION}; refusing to drop them"
        )
    return cols


def _conform(conn: sqlite3.Connection, ref: sqlite3.Connection) -> None:
    """Rebuild every existing table whose shape is not the current one:
    create it anew, copy the rows by column name, swap it in (SQLite has
    no ALTER for keys). A column the new table would lose is refused, never
    dropped."""
    have = _names(conn, "table")
    for t in TABLES:
        if t.name not in have:
            continue
        old, new = shape(conn, t.name), shape(ref, t.name)
        if old["columns"] == new["columns"] and old["fks"] == new["fks"]:
            continue
        cols = _keeps_every_column(t, old)
        tmp = f"_gf_new_{t.name}"
        conn.execute(f"DROP TABLE IF EXISTS {_q(tmp)}")
        conn.execute(t.create_sql(tmp))
        conn.execute(f"INSERT INTO {_q(tmp)} ({_qs(cols)}) SELECT {_qs(cols)} FROM {_q(t.name)}")
        conn.execute(f"DROP TABLE {_q(t.name)}")
        conn.execute(f"ALTER TABLE {_q(tmp)} RENAME TO {_q(t.name)}")


def _from_0(conn: sqlite3.Connection, ref: sqlite3.Connection) -> None:
    """0: empty, or tables that a store made on a connection open_db never
    checked (its tests, the library used alone): they take today's shape."""
    _conform(conn, ref)


def _from_1(conn: sqlite3.Connection, ref: sqlite3.Connection) -> None:
    """1 -> 2: foreign keys declared, stacks' module/offset where the first
    layout of version 1 lacked them (NULL: named at show time, as before),
    calls' columns in the record's order. Each is a rebuild with the rows
    copied; the missing tables are created after the migrations."""
    _conform(conn, ref)


def _from_2(conn: sqlite3.Connection, ref: sqlite3.Connection) -> None:
    """2 -> 3: stacks gain build_id, method and stop (NULL in older rows:
    their frames came from frame pointers, as `show` says)."""
    _conform(conn, ref)


def _from_3(conn: sqlite3.Connection, ref: sqlite3.Connection) -> None:
    """3 -> 4: funcs gain aliases (NULL in older rows: not recorded)."""
    _conform(conn, ref)


def _from_4(conn: sqlite3.Connection, ref: sqlite3.Connection) -> None:
    """4 -> 5: the pyframes table (created with the missing tables; older
    faults have no Python frames recorded)."""
    _conform(conn, ref)


def _from_5(conn: sqlite3.Connection, ref: sqlite3.Connection) -> None:
    """5 -> 6: the targets table (created with the missing tables; older
    runs have no target identity recorded)."""
    _conform(conn, ref)


def _from_6(conn: sqlite3.Connection, ref: sqlite3.Connection) -> None:
    """6 -> 7: the explorations, explore_points and explore_trials tables
    (`gpufault explore`; created with the missing tables), and targets.root
    (the host path of a container's root; NULL in older rows)."""
    _conform(conn, ref)


def _from_7(conn: sqlite3.Connection, ref: sqlite3.Connection) -> None:
    """7 -> 8: load_windows gains the streamed terms (ttft/itl percentiles,
    output_tokens_per_s, goodput), hypothesis_results and judgements an
    slo_id, experiment_steps a thread_name (NULL in older rows: not
    recorded; an older run's windows had no streamed terms stored); the
    slo_windows and slo_burns tables are created with the missing ones."""
    _conform(conn, ref)


MIGRATIONS: dict[int, Callable[[sqlite3.Connection, sqlite3.Connection], None]] = {
    0: _from_0,
    1: _from_1,
    2: _from_2,
    3: _from_3,
    4: _from_4,
    5: _from_5,
    6: _from_6,
    7: _from_7,
}
assert sorted(MIGRATIONS) == list(range(SCHEMA_VERSION)), "a migration per earlier version"


def _complete(conn: sqlite3.Connection) -> bool:
    return (
        user_version(conn) == SCHEMA_VERSION
        and {t.name for t in TABLES} <= _names(conn, "table")
        and {n for t in TABLES for n, _ in t.indexes} <= _names(conn, "index")
        and not _stale_views(conn)
    )


def _as_created(conn: sqlite3.Connection) -> bool:
    """Every table of ours the file has is the one ensure_schema creates,
    to the letter (SQLite keeps a CREATE's text, less IF NOT EXISTS): then
    nothing in it can be refused, without comparing shapes against an
    in-memory reference (~7 ms of every open before a trace attaches)."""
    stored = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"))
    for t in TABLES:
        got = stored.get(t.name)
        if got is not None and got != t.create_sql().replace(" IF NOT EXISTS ", " ", 1):
            return False
    return True


def check(db: Any) -> None:
    """Raise SchemaError for a database ensure_schema would refuse or
    leave unusable, found without writing (store.open_db runs it on a
    read-only connection before anything is converted or armed): a newer
    version; at the current one, a table of ours in another shape (it is
    not conformed, so the first insert would fail mid-run); at an older
    one, a table whose rebuild would drop a column or leave a NOT NULL
    column empty."""
    conn = _conn(db)
    version = user_version(conn)
    if version > SCHEMA_VERSION:
        raise SchemaError(f"schema {version} is newer than this gpufault's ({SCHEMA_VERSION})")
    if version == SCHEMA_VERSION and _as_created(conn):
        return
    have = _names(conn, "table")
    ref = reference()
    try:
        for t in TABLES:
            if t.name not in have:
                continue
            old, new = shape(conn, t.name), shape(ref, t.name)
            if version == SCHEMA_VERSION:
                if old["columns"] != new["columns"]:
                    raise SchemaError(
                        f"table {t.name} is not schema {SCHEMA_VERSION}'s "
                        f"(columns {', '.join(c[0] for c in old['columns'][:6])})"
                    )
                continue
            cols = _keeps_every_column(t, old)
            empty = [c[0] for c in new["columns"] if c[2] and c[0] not in cols]
            if empty and conn.execute(f"SELECT 1 FROM {_q(t.name)} LIMIT 1").fetchone():
                raise SchemaError(
                    f"table {t.name}: no column {', '.join(empty)}, which schema "
                    f"{SCHEMA_VERSION} requires"
                )
    finally:
        ref.close()


def ensure_schema(db: Any) -> None:
    """Bring the database to SCHEMA_VERSION: migrations from its
    user_version, then every missing table and index. Idempotent, and
    writes nothing when all is there already (so it is safe on a read-only
    connection of a current file). One transaction: a failed migration
    leaves the file as it was."""
    conn = _conn(db)
    if _complete(conn):
        return
    # Our own transaction, rolled back whole on failure; inside a caller's,
    # a savepoint of it. What the file holds is read inside it: read before,
    # another opener of the same new file could commit its schema between
    # the reads (user_version 0, then its tables: migrations run on a
    # current schema; tests/test_store_concurrent_open.py).
    outer = conn.in_transaction
    conn.execute("SAVEPOINT gf_schema" if outer else "BEGIN IMMEDIATE")
    ref = None
    try:
        if _complete(conn):  # another opener made it meanwhile
            version = SCHEMA_VERSION
        else:
            version = user_version(conn)
        if version > SCHEMA_VERSION:
            raise SchemaError(f"schema {version} is newer than this gpufault's ({SCHEMA_VERSION})")
        # A new, empty file has nothing to migrate: no reference schema to
        # compare with (a few ms of a new database's open, before the probes).
        fresh = version == 0 and not _names(conn, "table") and not _names(conn, "view")
        ref = None if fresh or version == SCHEMA_VERSION else reference()
        if ref is not None and version < SCHEMA_VERSION:
            # A table rebuild (DROP, then RENAME) fails on a view that names
            # the table: the views go first and are made again below.
            for view in VIEW_NAMES:
                conn.execute(f"DROP VIEW IF EXISTS {_q(view)}")
            for step in range(version, SCHEMA_VERSION):
                MIGRATIONS[step](conn, ref)
        for t in TABLES:
            conn.execute(t.create_sql())
            for s in t.index_sql():
                conn.execute(s)
        for v in _stale_views(conn):
            conn.execute(f"DROP VIEW IF EXISTS {_q(v)}")
            conn.execute(view_sql(v))
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except BaseException:
        if outer:
            conn.execute("ROLLBACK TO gf_schema")
            conn.execute("RELEASE gf_schema")
        else:
            conn.rollback()
        raise
    finally:
        if ref is not None:
            ref.close()
    if outer:
        conn.execute("RELEASE gf_schema")
    else:
        conn.commit()


def overlay(db: Any) -> None:
    """For a connection that may not write (an older file opened mode=ro):
    a missing table gets an empty TEMP stand-in, a table missing columns a
    TEMP view adding them as NULL. Unqualified names find temp objects
    first, so queries read the current schema; the file is not touched."""
    conn = _conn(db)
    have = _names(conn, "table")
    for t in TABLES:
        if t.name not in have:
            conn.execute(t.create_sql(temp=True))
            continue
        cols = {r[1] for r in conn.execute(f"PRAGMA main.table_info({_q(t.name)})")}
        if set(t.column_names) <= cols:
            continue
        sel = ", ".join(_q(c) if c in cols else f"NULL AS {_q(c)}" for c in t.column_names)
        conn.execute(
            f"CREATE TEMP VIEW IF NOT EXISTS {_q(t.name)} AS SELECT {sel} FROM main.{_q(t.name)}"
        )
    # Views a file lacks (or has in an older form): TEMP ones shadow them.
    temp = _names(conn, "view", "temp")
    for v in _stale_views(conn):
        if v not in temp:
            conn.execute(view_sql(v, temp=True))
