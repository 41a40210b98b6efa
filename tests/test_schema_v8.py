"""Schema 7 -> 8 (pyctl/evidence/schema.py): load_windows' streamed terms,
the slo_id of hypothesis and judgement rows, experiment_steps.thread_name
and the burn-rate SLO tables. A version 7 file (the current tables less
what 8 added) migrates with its rows intact, the new columns NULL, and
merge carries the new columns and tables across stores. No root."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

from pyctl.evidence import schema

# What 8 added, by table (a table in NEW8 did not exist in 7).
ADDED = {
    "load_windows": {
        "ttft_p50", "ttft_p95", "ttft_p99", "itl_p50", "itl_p95", "itl_p99",
        "output_tokens_per_s", "goodput",
    },
    "hypothesis_results": {"slo_id"},
    "judgements": {"slo_id"},
    "experiment_steps": {"thread_name"},
}  # fmt: skip
NEW8 = {"slo_windows", "slo_burns"}


def _v7(path: Path) -> sqlite3.Connection:
    """A file as schema 7 wrote it: every table of 7, user_version 7."""
    con = sqlite3.connect(path)
    for t in schema.TABLES:
        if t.name in NEW8:
            continue
        drop = ADDED.get(t.name, set())
        t7 = dataclasses.replace(t, columns=tuple(c for c in t.columns if c.split()[0] not in drop))
        con.execute(t7.create_sql())
        for s in t7.index_sql():
            con.execute(s)
    con.execute("PRAGMA user_version=7")
    con.execute("INSERT INTO experiments (id, name, slo_id) VALUES ('x1', 'e', 'chat')")
    con.execute(
        'INSERT INTO load_windows (experiment_id, start, "end", count, p99, phase) '
        "VALUES ('x1', 1.0, 2.0, 20, 0.25, 'fault')"
    )
    con.execute(
        "INSERT INTO hypothesis_results (experiment_id, phase, probe, ok) "
        "VALUES ('x1', 'during', 'load.p99', 0)"
    )
    con.execute("INSERT INTO experiment_steps (experiment_id, idx, name) VALUES ('x1', 0, 's')")
    con.commit()
    return con


def test_the_v7_stand_in_is_what_7_was() -> None:
    # The test is only as good as its version 7: 8 added exactly these.
    assert schema.SCHEMA_VERSION == 8
    assert NEW8 <= {t.name for t in schema.TABLES}
    for name, cols in ADDED.items():
        assert cols <= set(schema.BY_NAME[name].column_names), name


def test_version_7_migrates_with_its_rows_intact(tmp_path: Path) -> None:
    con = _v7(tmp_path / "gf.db")
    schema.ensure_schema(con)
    assert schema.user_version(con) == 8
    ref = schema.reference()
    for t in schema.TABLES:
        assert schema.shape(con, t.name) == schema.shape(ref, t.name), t.name
    row = con.execute(
        'SELECT start, "end", count, p99, phase, ttft_p99, itl_p99, output_tokens_per_s, '
        "goodput FROM load_windows"
    ).fetchone()
    assert row == (1.0, 2.0, 20, 0.25, "fault", None, None, None, None)
    assert con.execute("SELECT probe, ok, slo_id FROM hypothesis_results").fetchall() == [
        ("load.p99", 0, None)
    ]
    assert con.execute("SELECT name, thread_name FROM experiment_steps").fetchall() == [("s", None)]
    for t in NEW8:
        assert con.execute(f"SELECT count(*) FROM {t}").fetchone() == (0,)


def test_a_version_7_file_reads_as_8_without_being_converted(tmp_path: Path) -> None:
    _v7(tmp_path / "gf.db").close()
    con = sqlite3.connect(f"file:{tmp_path / 'gf.db'}?mode=ro", uri=True)
    schema.check(con)  # nothing 8 needs is refused
    schema.overlay(con)
    assert con.execute("SELECT ttft_p99, goodput FROM load_windows").fetchall() == [(None, None)]
    assert con.execute("SELECT * FROM slo_burns").fetchall() == []
    assert schema.user_version(con) == 7


def test_merge_carries_the_new_columns_and_tables(tmp_path: Path) -> None:
    from pyctl.evidence import merge
    from pyctl.experiment import burn
    from pyctl.experiment import evidence as E
    from pyctl.experiment.loadgen import WindowStats

    ev = E.Evidence(tmp_path / "a.db")
    ev.id = "x00000001"
    ev.db.conn.execute("INSERT INTO experiments (id, name) VALUES ('x00000001', 'e')")
    w = WindowStats(1.0, 2.0, 10, 0.1, 0.2, 0.3, 0.0, 10.0, ttft_p99=0.05, itl_p50=0.01)
    rec = E.Record(
        load_windows=[E.LoadWindow(w, "fault")],
        hypotheses=[E.Hypothesis("during", "slo.chat", False, "20x", "< 14.4x", "", "chat")],
        slo_windows=[burn.Counted("chat", 1.0, 2.0, 10, 7, "fault")],
        slo_burns=[burn.Burn("chat", "14.4x 12s/1s", 12, 1, 14.4, 2.0, "fault", 30.0, 30.0)],
    )
    ev.finish("fail", "slo chat burnt", rec)
    (alert,) = E.results(ev.db, "x00000001")["slo_alerts"]  # results --json
    assert alert == {"slo_id": "chat", "alert": "14.4x 12s/1s", "factor": 14.4,
                     "worst_long_burn": 30.0, "worst_short_burn": 30.0, "firing_windows": 1,
                     "first_fired_at": 2.0}  # fmt: skip
    ev.close()
    merge.merge([tmp_path / "a.db"], tmp_path / "all.db")
    con = sqlite3.connect(tmp_path / "all.db")
    assert con.execute("SELECT ttft_p99, itl_p50 FROM load_windows").fetchall() == [(0.05, 0.01)]
    assert con.execute("SELECT slo_id FROM hypothesis_results").fetchall() == [("chat",)]
    assert con.execute("SELECT total, good FROM slo_windows").fetchall() == [(10, 7)]
    assert con.execute("SELECT firing, long_burn FROM slo_burns").fetchall() == [(1, 30.0)]
