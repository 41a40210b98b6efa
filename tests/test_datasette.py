"""Datasette over a real evidence database: the shipped metadata stays in
step with docs/schema.md, the views exist and are documented, and a canned
query returns a fault's chain. In-process (Datasette's own client), no
port, no root, no BPF."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from evidence_rows import fill

from pyctl.evidence import datasette as meta
from pyctl.evidence import schema

REPO = Path(__file__).resolve().parent.parent


def test_shipped_metadata_is_generated_from_the_docs() -> None:
    assert json.loads(meta.PATH.read_text()) == meta.metadata(), (
        "pyctl/evidence/datasette.json is stale: run `python -m pyctl.evidence.datasette`"
    )


def test_every_table_view_and_column_is_described(tmp_path: Path) -> None:
    con = sqlite3.connect(tmp_path / "gf.db")
    schema.ensure_schema(con)
    described = meta.metadata()["databases"]["gpufault"]["tables"]
    for kind in ("table", "view"):
        for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = ?", (kind,)):
            cols = [r[1] for r in con.execute(f'PRAGMA table_info("{name}")')]
            assert list(described[name]["columns"]) == cols, name
            assert described[name]["description"], name
            assert all(described[name]["columns"].values()), name


def test_views_are_documented_as_views() -> None:
    text = (REPO / "docs" / "schema.md").read_text()
    views_part = text.split("\n# Views\n", 1)[1]
    assert re.findall(r"^### (\w+)$", views_part, re.M) == list(schema.views())


def test_a_reader_of_a_file_without_views_gets_temp_ones(tmp_path: Path) -> None:
    from pyctl.evidence import store

    db = tmp_path / "gf.db"
    fill(db)
    con = sqlite3.connect(db)
    con.execute("DROP VIEW faults_readable")
    con.commit()
    con.close()
    ro = store.open_db(db, readonly=True)
    try:
        assert ro.conn.execute("SELECT count(*) FROM faults_readable").fetchone() == (3,)
    finally:
        ro.close()
    # The file itself was not changed by the reader.
    con = sqlite3.connect(db)
    assert "faults_readable" not in {
        r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'view'")
    }


def test_views_read_in_words(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    ids = fill(db)
    con = sqlite3.connect(db)
    f1, _, f3 = ids["faults"]
    row = con.execute(
        "SELECT retval_name, injected, corrupt_addr FROM faults_readable WHERE fault_id = ?",
        (f1,),
    ).fetchone()
    assert row == ("CUDA_ERROR_OUT_OF_MEMORY", "yes", None)
    (addr,) = con.execute(
        "SELECT corrupt_addr FROM faults_readable WHERE fault_id = ?", (ids["faults"][1],)
    ).fetchone()
    assert addr == "0x7ffd12345678"
    assert con.execute(
        "SELECT value FROM registers_readable WHERE fault_id = ? AND reg = 'ax'", (f1,)
    ).fetchone() == ("0xffffffffffffffff",)
    assert con.execute(
        "SELECT address FROM stacks_readable WHERE fault_id = ?", (f1,)
    ).fetchone() == ("0xffff7f7379659a00",)
    whats = [w for (w,) in con.execute("SELECT what FROM links_readable ORDER BY ts_ns")]
    assert whats == [
        "SIGCHLD: this signal cannot follow from a fault",
        "cuMemAlloc_v2 returned CUDA_ERROR_OUT_OF_MEMORY",
        "SIGSEGV: injected signal",
        "killed by SIGSEGV",
    ]
    assert f3


def _get(ds: Any, path: str) -> Any:
    async def go() -> Any:
        r = await ds.client.get(path)
        assert r.status_code == 200, (path, r.text[:500])
        return r.json()

    return asyncio.run(go())


def test_datasette_serves_the_canned_queries(tmp_path: Path) -> None:
    datasette_app = pytest.importorskip("datasette.app")
    db = tmp_path / "gpufault.db"
    ids = fill(db)
    f1 = ids["faults"][0]
    ds = datasette_app.Datasette(
        [str(db)], metadata=json.loads(meta.PATH.read_text()), immutables=[]
    )
    chain = _get(ds, f"/gpufault/fault_chain.json?fault_id={f1}&_shape=array")
    parts = [r["part"] for r in chain]
    assert parts[0] == "fault" and chain[0]["what"] == "cuMemAlloc_v2 #3 fail via copilot"
    assert "injected CUDA_ERROR_OUT_OF_MEMORY" in chain[0]["value"]
    assert {"arg", "register", "frame", "followed: error-return", "xid", "anchor"} <= set(parts)
    frame = next(r for r in chain if r["part"] == "frame")
    assert frame["what"] == "0xffff7f7379659a00"
    runs = _get(ds, "/gpufault/faults_per_run.json?_shape=array")
    assert [(r["run_id"], r["faults"], r["links"]) for r in runs] == [(ids["run"], 3, 4)]
    calls = _get(ds, f"/gpufault/calls_per_function.json?run_id={ids['run']}&_shape=array")
    assert calls == []
    assert _get(ds, "/gpufault/experiments_with_verdicts.json?_shape=array") == []
    assert _get(ds, "/gpufault/explorations.json?_shape=array") == []
    assert _get(ds, "/gpufault/slo_alerts.json?experiment_id=x1&_shape=array") == []
    # The descriptions reach Datasette as the schema page words them.
    served = _get(ds, "/-/metadata.json")["databases"]["gpufault"]["tables"]
    assert served["faults"]["columns"]["wall"] == "Unix time the fire was recorded"
    assert served["faults_readable"]["description"].startswith("The faults table in words")


def test_views_version_follows_their_sql() -> None:
    assert tuple(schema.views()) == schema.VIEW_NAMES
    assert schema.views_sha256() == schema.VIEWS_SHA256, (
        "the views' SQL changed (a catalog's codes?): bump schema.VIEWS_VERSION and set "
        f"VIEWS_SHA256 = {schema.views_sha256()!r}, so that existing files get the new views"
    )


def test_opening_a_current_file_builds_no_view_sql(tmp_path: Path) -> None:
    # The catalogs' import (~0.15 s) stays off the path to a trace's attach.
    db = tmp_path / "gf.db"
    fill(db)
    schema._VIEWS = None
    con = sqlite3.connect(db)
    schema.ensure_schema(con)
    assert schema._VIEWS is None
