"""The one evidence schema (pyctl/evidence/schema.py): docs/schema.md lists
exactly its tables and columns, every earlier version migrates with its
rows intact, and a reader sees an older file as the current schema
without converting it. No root, no BPF."""

from __future__ import annotations

import hashlib
import re
import sqlite3
import struct
from pathlib import Path

import pytest

from pyctl.bpf import abi
from pyctl.evidence import query, schema, store

REPO = Path(__file__).resolve().parent.parent
V1_SQL = (Path(__file__).parent / "data" / "schema_v1.sql").read_text()
# The first layout of version 1 (f8e2143): stacks without module/offset.
V1_EARLY_SQL = re.sub(
    r'"symbol" TEXT,\s+"module" TEXT,\s+"offset" INTEGER,', '"symbol" TEXT,', V1_SQL
)


def live(con: sqlite3.Connection) -> dict[str, list[str]]:
    """Every table and its columns, in order, as SQLite reports them."""
    names = [
        r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")
    ]
    return {n: [r[1] for r in con.execute(f'PRAGMA table_info("{n}")')] for n in names}


def documented() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    table = None
    for ln in (REPO / "docs" / "schema.md").read_text().splitlines():
        if m := re.match(r"## (\w+)\s*$", ln):
            table = m.group(1)
            out[table] = []
        elif (m := re.match(r"- `(\w+)`: \S", ln)) and table:
            out[table].append(m.group(1))
    return out


def fresh(tmp_path: Path, sql: str = "") -> sqlite3.Connection:
    con = sqlite3.connect(tmp_path / "gf.db")
    if sql:
        con.executescript(sql)
    return con


def test_docs_list_exactly_the_live_tables_and_columns(tmp_path: Path) -> None:
    con = fresh(tmp_path)
    schema.ensure_schema(con)
    assert documented() == live(con)
    assert schema.user_version(con) == schema.SCHEMA_VERSION


def test_ensure_schema_is_idempotent_and_then_writes_nothing(tmp_path: Path) -> None:
    con = fresh(tmp_path)
    schema.ensure_schema(con)
    before = con.total_changes, (tmp_path / "gf.db").read_bytes()
    schema.ensure_schema(con)
    assert (con.total_changes, (tmp_path / "gf.db").read_bytes()) == before
    # And on a read-only connection of a current file: nothing to do, no error.
    ro = sqlite3.connect(f"file:{tmp_path / 'gf.db'}?mode=ro", uri=True)
    schema.ensure_schema(ro)


def test_foreign_keys_are_declared_where_rows_refer_to_each_other() -> None:
    ref = schema.reference()
    fks = {
        (t.name, r[3], r[2])
        for t in schema.TABLES
        for r in ref.execute(f'PRAGMA foreign_key_list("{t.name}")')
    }
    for child in ("specs", "funcs", "faults", "links", "calls", "xids", "tok_cases"):
        assert (child, "run_id", "runs") in fks, child
    for child in ("registers", "args", "stacks", "pyframes", "links", "calls", "xids"):
        assert (child, "fault_id", "faults") in fks, child
    assert ("experiment_steps", "experiment_id", "experiments") in fks
    assert ("experiment_steps", "run_id", "runs") in fks


def _fill_v1(con: sqlite3.Connection) -> dict[str, list[dict]]:
    """One row in every table of a v1 file, with every column set."""
    rows: dict[str, list[dict]] = {}
    sample = {
        "TEXT": lambda t, c: f"{t}-{c}",
        "INTEGER": lambda t, c: len(c),
        "REAL": lambda t, c: len(c) + 0.5,
        "BLOB": lambda t, c: c.encode(),
    }
    for name in live(con):
        typed = {r[1]: r[2] for r in con.execute(f'PRAGMA table_info("{name}")')}
        row = {c: sample[t](name, c) for c, t in typed.items()}
        if name in {"runs", "calls", "specs", "funcs", "faults", "links", "xids", "tok_cases"}:
            row["run_id"] = "1a2b3c4d"
        if "fault_id" in row:
            row["fault_id"] = "1a2b3c4d-1"
        con.execute(
            f'INSERT INTO "{name}" ({", ".join(row)}) VALUES ({", ".join("?" * len(row))})',
            list(row.values()),
        )
        rows[name] = [row]
    con.commit()
    return rows


@pytest.mark.parametrize("sql", [V1_SQL, V1_EARLY_SQL], ids=["v1", "v1-first-layout"])
def test_version_1_migrates_with_its_rows_intact(tmp_path: Path, sql: str) -> None:
    con = fresh(tmp_path, sql)
    assert schema.user_version(con) == 1
    rows = _fill_v1(con)
    schema.ensure_schema(con)
    assert schema.user_version(con) == schema.SCHEMA_VERSION
    ref = schema.reference()
    for t in schema.TABLES:
        assert schema.shape(con, t.name) == schema.shape(ref, t.name), t.name
    for name, want in rows.items():
        got = [
            dict(zip([c[0] for c in cur.description], r, strict=True))
            for cur in [con.execute(f'SELECT * FROM "{name}"')]
            for r in cur.fetchall()
        ]
        assert len(got) == len(want), name
        for g, w in zip(got, want, strict=True):
            assert {k: g[k] for k in w} == w, name
            # A column the old layout lacked is NULL, nothing else is new.
            assert all(g[k] is None for k in g if k not in w), name


def test_store_made_tables_without_a_version_take_the_current_shape(tmp_path: Path) -> None:
    # A store used on a connection open_db never checked left user_version 0.
    con = fresh(
        tmp_path,
        'CREATE TABLE "tok_cases" ("fault_id" TEXT PRIMARY KEY, "run_id" TEXT,'
        " \"seq\" INTEGER); INSERT INTO tok_cases VALUES ('ab-1', 'ab', 1);",
    )
    schema.ensure_schema(con)
    assert con.execute("SELECT fault_id, seq, campaign FROM tok_cases").fetchall() == [
        ("ab-1", 1, None)
    ]
    assert schema.shape(con, "tok_cases") == schema.shape(schema.reference(), "tok_cases")


def test_a_migration_that_would_drop_a_column_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    con = fresh(tmp_path, V1_SQL)
    con.execute("ALTER TABLE faults ADD COLUMN someone_elses TEXT")
    con.execute("INSERT INTO runs (run_id) VALUES ('aa')")
    con.commit()
    before = (tmp_path / "gf.db").read_bytes()
    with pytest.raises(schema.SchemaError, match="someone_elses"):
        schema.ensure_schema(con)
    assert not con.in_transaction
    assert schema.user_version(con) == 1
    assert (tmp_path / "gf.db").read_bytes() == before


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    con = fresh(tmp_path, f"PRAGMA user_version={schema.SCHEMA_VERSION + 1};")
    with pytest.raises(schema.SchemaError, match="newer"):
        schema.ensure_schema(con)


def test_open_db_migrates_a_version_1_file(tmp_path: Path) -> None:
    con = fresh(tmp_path, V1_SQL)
    con.execute("INSERT INTO runs (run_id, status) VALUES ('1a2b3c4d', 'done')")
    con.commit()
    con.close()
    db = store.open_db(tmp_path / "gf.db")
    try:
        assert schema.user_version(db) == schema.SCHEMA_VERSION
        assert db.conn.execute("SELECT status FROM runs").fetchall() == [("done",)]
        assert "experiments" in db.table_names()
    finally:
        db.close()


def test_a_reader_sees_a_version_1_file_as_the_current_schema_unchanged(tmp_path: Path) -> None:
    con = fresh(tmp_path, V1_EARLY_SQL)
    con.executescript(
        "DROP TABLE anchors; DROP TABLE xids;"  # files older than these stores lack them
        "INSERT INTO runs (run_id) VALUES ('1a2b3c4d');"
        "INSERT INTO specs VALUES ('1a2b3c4d', 0, 'fail cuMemAlloc', '{}');"
        "INSERT INTO faults (fault_id, run_id, seq, spec, function, library, action, mechanism,"
        " call_seq, pid, tid, comm, wall) VALUES ('1a2b3c4d-1', '1a2b3c4d', 1, 0, 'f', 'l',"
        " 'fail', 'regs', 1, 2, 3, 'c', 1.0);"
        "INSERT INTO stacks VALUES ('1a2b3c4d-1', 0, 4096, 'main');"
    )
    con.close()
    path = tmp_path / "gf.db"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    db = store.open_db(path, readonly=True)
    try:
        doc = query.fault_chain(db, "1a2b3c4d-1")
        assert doc is not None
        assert doc["anchors"] == [] and doc["xids"] == []
        # Columns the old file lacks read as NULL (the overlay's stand-ins).
        assert doc["stack"] == [{"depth": 0, "address": 4096, "symbol": "main", "method": None,
                                 "module": None, "build_id": None, "offset": None}]  # fmt: skip
        assert db.conn.execute("SELECT count(*) FROM experiments").fetchone() == (0,)
    finally:
        db.close()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gf.db"]


def test_the_experiment_tables_have_one_definition() -> None:
    # pyctl/experiment/evidence.py creates its tables from the schema's own
    # script: no second DDL to drift from it.
    from pyctl.experiment.evidence import EXPERIMENT_DDL

    assert EXPERIMENT_DDL == schema.script(schema.EXPERIMENT_TABLES)
    src = (Path(__file__).resolve().parent.parent / "pyctl/experiment/evidence.py").read_text()
    assert "CREATE TABLE" not in src


def test_calls_insert_is_derived_from_the_call_record(tmp_path: Path) -> None:
    con = fresh(tmp_path)
    schema.ensure_schema(con)
    fmt = struct.Struct(abi.CALL_RECORD_FMT)
    assert len(abi.CALL_SCALARS) == len(fmt.unpack(bytes(fmt.size)))
    vals = {n: i + 10 for i, n in enumerate(abi.CALL_SCALARS)}
    vals["cookie"] = abi.cookie(3, 5)
    vals["fault_seq"] = 9
    rec = fmt.pack(*(vals[n] for n in abi.CALL_SCALARS))
    con.executemany(store._CALL_RECORD_SQL.format(run="1a2b3c4d"), list(fmt.iter_unpack(rec)))
    cur = con.execute("SELECT * FROM calls")
    row = dict(zip([c[0] for c in cur.description], cur.fetchone(), strict=True))
    assert row["run_id"] == "1a2b3c4d"
    assert (row["spec"], row["func"], row["fault_id"]) == (3, 5, "1a2b3c4d-9")
    for n in ("kind", "ts_ns", "latency_ns", "call_seq", "arg1", "arg6", "ret", "pid", "tid"):
        assert row[n] == vals[n], n


@pytest.mark.parametrize("n", [0, 1, 47, 48, 49, 96, 4096 + 5])
def test_call_records_insert_in_statements_of_many_rows(tmp_path: Path, n: int) -> None:
    # store.insert_call_records binds CALL_ROWS_PER_INSERT records a
    # statement and the rest one by one: every record one row, in order,
    # each column what the record says.
    fmt = struct.Struct(abi.CALL_RECORD_FMT)
    recs = []
    for i in range(n):
        vals = {name: (i * 31 + j) % 997 for j, name in enumerate(abi.CALL_SCALARS)}
        vals["cookie"] = abi.cookie(i % 3, i % 7)
        vals["fault_seq"] = i if i % 5 == 0 else 0
        vals["ret"] = -i
        vals["arg1"] = -(1 << 63) + i  # a u64 above 2^63, as read (signed)
        recs.append(fmt.unpack(fmt.pack(*(vals[name] for name in abi.CALL_SCALARS))))
    con = sqlite3.connect(tmp_path / "gf.db")
    schema.ensure_schema(con)
    with con:
        store.insert_call_records(store.Database(con), "1a2b3c4d", recs)
    cur = con.execute("SELECT * FROM calls ORDER BY rowid")
    names = [c[0] for c in cur.description]
    got = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    assert len(got) == n
    for rec, row in zip(recs, got, strict=True):
        v = dict(zip(abi.CALL_SCALARS, rec, strict=True))
        want = {k: v[k] for k in names if k in v}
        want |= {"run_id": "1a2b3c4d", "spec": v["cookie"] >> 32, "func": v["cookie"] & 0xFFFFFFFF,
                 "fault_id": f"1a2b3c4d-{v['fault_seq']}" if v["fault_seq"] else None}  # fmt: skip
        assert row == want


def test_experiment_tables_script_makes_the_schemas_tables() -> None:
    con = sqlite3.connect(":memory:")
    con.executescript(schema.script(schema.EXPERIMENT_TABLES))
    ref = schema.reference()
    for n in schema.EXPERIMENT_TABLES:
        assert schema.shape(con, n) == schema.shape(ref, n), n


def _sqlite_master(path: Path) -> list[tuple]:
    con = sqlite3.connect(path)
    try:
        return con.execute(
            "SELECT type, name, sql FROM sqlite_master ORDER BY type, name"
        ).fetchall()
    finally:
        con.close()


def test_a_new_database_takes_its_views_from_the_cache_and_they_are_the_built_ones(
    tmp_path: Path,
) -> None:
    """A new file's views come from the disk cache in a later process,
    without the catalogs (their import is most of a new database's open
    before a trace attaches), and the file is the same as one whose views
    were built; an entry of another shape is not used."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    code = (
        "import sys, sqlite3\n"
        "from pyctl.evidence import schema\n"
        "con = sqlite3.connect(sys.argv[1]); schema.ensure_schema(con); con.commit()\n"
        "print(sorted(m for m in sys.modules if m.startswith('pyctl.catalog')))\n"
    )
    env = dict(os.environ, GPUFAULT_CACHE_DIR=str(cache))

    def new_db(name: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / name)],
            env=env, capture_output=True, text=True, check=True, cwd=REPO,
        )  # fmt: skip
        return done.stdout.strip()

    assert new_db("built.db") != "[]"  # a miss builds them from the catalogs
    assert new_db("cached.db") == "[]"
    assert _sqlite_master(tmp_path / "cached.db") == _sqlite_master(tmp_path / "built.db")
    # The entry is what views() keys by; a torn or foreign one is not used.
    (entry,) = (cache / "views").iterdir()
    entry.write_bytes(__import__("pickle").dumps({"faults_readable": "SELECT 1"}))
    assert new_db("after-foreign.db") != "[]"
    assert _sqlite_master(tmp_path / "after-foreign.db") == _sqlite_master(tmp_path / "built.db")


def test_a_new_file_and_an_empty_version_0_file_get_the_same_schema(tmp_path: Path) -> None:
    fresh = sqlite3.connect(tmp_path / "fresh.db")
    schema.ensure_schema(fresh)
    fresh.commit()
    fresh.close()
    # Version 0 with a table some store made: the migration path.
    old = sqlite3.connect(tmp_path / "old.db")
    old.execute(schema.BY_NAME["runs"].create_sql())
    old.commit()
    schema.ensure_schema(old)
    old.commit()
    old.close()
    assert _sqlite_master(tmp_path / "fresh.db") == _sqlite_master(tmp_path / "old.db")


def test_check_takes_a_file_as_created_without_the_reference_and_refuses_another_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """check() on every open of an existing file: one whose tables are the
    CREATEs ensure_schema runs is taken at once; one whose table of ours
    differs (at the current version) is compared shape by shape and
    refused, as before."""
    ours = sqlite3.connect(tmp_path / "ours.db")
    schema.ensure_schema(ours)
    ours.commit()

    def no_reference() -> sqlite3.Connection:
        raise AssertionError("a file as created needs no reference schema")

    with monkeypatch.context() as m:
        m.setattr(schema, "reference", no_reference)
        schema.check(ours)
    theirs = sqlite3.connect(tmp_path / "theirs.db")
    theirs.executescript(
        "CREATE TABLE runs (run_id TEXT PRIMARY KEY, note TEXT); "
        f"PRAGMA user_version={schema.SCHEMA_VERSION};"
    )
    with pytest.raises(schema.SchemaError, match="table runs is not schema"):
        schema.check(theirs)
    # Same columns, other text (a store's own CREATE): still accepted.
    spaced = sqlite3.connect(tmp_path / "spaced.db")
    spaced.execute(schema.BY_NAME["runs"].create_sql().replace("(", " ( ", 1))
    spaced.execute(f"PRAGMA user_version={schema.SCHEMA_VERSION}")
    schema.check(spaced)
