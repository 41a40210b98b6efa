"""Trace summaries from a run's per-call rows (no root: a synthetic run in a
temporary database), and the `calls` command through click's CliRunner."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pyctl.bpf.aggregate_abi import ERR_NONZERO32, SLOTS
from pyctl.calls import summary
from pyctl.cli.calls import calls, print_run_summary
from pyctl.evidence import store

CUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
OTHER = "/opt/app/libfoo.so"


def _latencies(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.lognormvariate(8, 1.5)) for _ in range(n)]


@pytest.fixture
def run_db(tmp_path: Path) -> tuple[Path, str, dict[str, list[int]]]:
    """One run: cuMemAlloc_v2 (catalogued: errors named) on two threads,
    foo (not catalogued), and a probed function never called."""
    p = tmp_path / "gf.db"
    db = store.open_db(p)
    rid = store.new_run(db, ["gpufault", "trace"], "trace")
    with db.conn:
        db["funcs"].insert_all(
            [
                {
                    "run_id": rid,
                    "func": 0,
                    "library": CUDA,
                    "symbol": "cuMemAlloc_v2",
                    "aliases": '["cuMemAlloc"]',
                },
                {"run_id": rid, "func": 1, "library": OTHER, "symbol": "foo"},
                {"run_id": rid, "func": 2, "library": OTHER, "symbol": "never_called"},
            ]
        )
    lat = {"alloc": _latencies(1000, 1), "foo": _latencies(300, 2)}
    rows = []
    for i, ns in enumerate(lat["alloc"]):
        # 7 x OUT_OF_MEMORY (2), 3 x NOT_INITIALIZED (3), 1 x an unknown code;
        # the register's high half is junk for an int: only (int)ret counts.
        ret = 2 if i < 7 else 3 if i < 10 else 12345 if i == 10 else 0
        rows.append((rid, i, ns, 0, 0, i + 1, None, 100, 101 + i % 2, 1, ret | (7 << 32)))
    for i, ns in enumerate(lat["foo"]):
        rows.append((rid, i, ns, 0, 1, i + 1, None, 100, 101, 1, -1))
    # Entry-only rows of foo (no return, no latency) and a follow row (a link,
    # not a call).
    rows += [(rid, 0, 0, 0, 1, 0, None, 100, 101, 2, 0)] * 5
    rows.append((rid, 0, 0, 0, 0, 0, f"{rid}-1", 100, 101, 3, 2))
    with db.conn:
        db.conn.executemany(
            "INSERT INTO calls (run_id, ts_ns, latency_ns, spec, func, call_seq, fault_id, "
            "pid, tid, kind, ret) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            rows,
        )
    store.end_run(db, rid, "done")
    db.close()
    return p, rid, lat


def _open(p: Path):
    return store.open_db(p, readonly=True)


def test_counts_errors_and_exact_percentiles(run_db) -> None:
    p, rid, lat = run_db
    s = summary.from_calls(_open(p), rid)
    by = {f.function: f for f in s.functions}
    assert [f.function for f in s.functions] == ["cuMemAlloc_v2", "foo", "never_called"]
    a = by["cuMemAlloc_v2"]
    assert (a.calls, a.returns, a.errors) == (1000, 1000, 11)
    assert a.rule.mode == ERR_NONZERO32 and a.rule.lib == "cuda"
    assert a.errors_by_code == {
        "CUDA_ERROR_OUT_OF_MEMORY": 7,
        "CUDA_ERROR_NOT_INITIALIZED": 3,
        "12345": 1,
    }
    for name, key in (("cuMemAlloc_v2", "alloc"), ("foo", "foo")):
        f = by[name]
        vals = np.array(lat[key])
        assert f.latency is not None and f.latency.exact
        for q in (50, 90, 99):
            want = int(np.percentile(vals, q, method="inverted_cdf"))
            assert getattr(f.latency, f"p{q}") == want, (name, q)
        assert f.latency.max == int(vals.max())
        assert f.latency.count == len(vals)
        # Histogram buckets exact: floor(log2(ns)), 0 and 1 in slot 0.
        want_hist = [0] * SLOTS
        for v in lat[key]:
            want_hist[min(max(v, 1).bit_length() - 1, SLOTS - 1)] += 1
        assert f.hist == want_hist
    foo = by["foo"]
    # Entry rows count as calls, with no return and no latency; foo's return
    # value is not classified (not in the catalog).
    assert (foo.calls, foo.returns) == (305, 300)
    assert foo.to_json()["errors"] is None
    assert by["never_called"].calls == 0 and by["never_called"].latency is None


def test_per_thread_split(run_db) -> None:
    p, rid, _ = run_db
    s = summary.from_calls(_open(p), rid, per_thread=True)
    got = {(f.function, f.tid): f.calls for f in s.functions}
    assert got == {("cuMemAlloc_v2", 101): 500, ("cuMemAlloc_v2", 102): 500, ("foo", 101): 305}
    errs = {(f.function, f.tid): f.errors for f in s.functions if f.function == "cuMemAlloc_v2"}
    assert sum(errs.values()) == 11


def test_text_fits_80_columns_and_names_codes(run_db) -> None:
    p, rid, _ = run_db
    text = summary.from_calls(_open(p), rid).render()
    lines = text.splitlines()
    assert all(len(ln) <= 80 for ln in lines), max(lines, key=len)
    assert lines[0].startswith(f"run {rid}: 1,305 calls to 3 functions")
    codes = "CUDA_ERROR_OUT_OF_MEMORY 7, CUDA_ERROR_NOT_INITIALIZED 3, 12345 1"
    assert f"  calls 1,000   errors 11:\n    {codes}\n" in text
    assert "  calls 305   errors -" in text
    assert "nsecs" in text and "distribution" in text and "|" in text
    assert lines[-1] == "not called: never_called"


def test_histogram_rendering_exact() -> None:
    hist = [0] * SLOTS
    hist[8], hist[9], hist[11] = 80, 40, 1
    out = summary.render_hist(hist)
    assert out[1].split("|")[0].split() == ["256", "->", "511", ":", "80"]
    assert out[1].count("*") == 40 and out[2].count("*") == 20
    assert out[3].split("|")[0].split()[-1] == "0"  # 1024-2047: empty, shown
    assert out[4].split("|")[0].split()[:3] == ["2048", "->", "4095"]
    assert out[4].count("*") == 1  # small but not empty: never drawn empty
    assert len(out) == 5
    last = [0] * SLOTS
    last[-1] = 3
    assert "-> inf" in summary.render_hist(last)[1]


def test_percentile_helpers() -> None:
    vals = sorted(_latencies(777, 5))
    for q in (1, 50, 90, 99, 100):
        assert summary.percentile(vals, q) == int(np.percentile(vals, q, method="inverted_cdf"))
    hist = [0] * SLOTS
    for v in vals:
        hist[summary.log2_slot(v)] += 1
    for q in (50, 90, 99):
        ub = summary.percentile_from_hist(hist, q, vals[-1])
        exact = summary.percentile(vals, q)
        assert exact <= ub <= max(2 * exact + 1, 1)  # an upper bound within its bucket


def test_json_shape(run_db) -> None:
    p, rid, _ = run_db
    doc = summary.from_calls(_open(p), rid).to_json()
    assert doc["run_id"] == rid and doc["source"] == "calls" and doc["calls"] == 1305
    f = doc["functions"][0]
    assert f["function"] == "cuMemAlloc_v2" and f["error_rule"] == "nonzero32"
    assert f["aliases"] == ["cuMemAlloc"] and doc["functions"][1]["aliases"] == []
    assert f["errors_by_code"]["CUDA_ERROR_OUT_OF_MEMORY"] == 7
    assert set(f["latency_ns"]) == {"count", "p50", "p90", "p99", "max", "mean", "exact"}
    assert sum(b["count"] for b in f["hist_log2_ns"]) == 1000
    json.dumps(doc)


def test_error_rule_needs_the_right_library() -> None:
    assert summary.error_rule("cuMemAlloc_v2", CUDA).mode == ERR_NONZERO32
    assert summary.error_rule("ncclAllReduce", "/x/libnccl.so.2").lib == "nccl"
    # A catalogued name in another catalogued library is not trusted.
    assert summary.error_rule("cuMemAlloc_v2", "/x/libnccl.so.2").mode == 0
    assert summary.error_rule("malloc", "/lib/libc.so.6").mode == 0


def test_calls_command(run_db) -> None:
    p, rid, _ = run_db
    r = CliRunner()
    res = r.invoke(calls, [rid, "--db", str(p)])
    assert res.exit_code == 0, res.output
    assert "CUDA_ERROR_OUT_OF_MEMORY 7" in res.output
    res = r.invoke(calls, ["last", "--db", str(p), "--json", "--per-thread"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["per_thread"] is True
    res = r.invoke(calls, ["--db", str(p)])  # bare: the last run
    assert res.exit_code == 0 and rid in res.output


def test_calls_command_errors_are_one_line(run_db, tmp_path: Path) -> None:
    p, _, _ = run_db
    r = CliRunner()
    res = r.invoke(calls, ["deadbeef", "--db", str(p)])
    assert res.exit_code == 2
    assert res.output.strip().count("\n") == 0
    assert res.output.startswith("gpufault: no run 'deadbeef'")
    res = r.invoke(calls, ["last", "--db", str(tmp_path / "none.db")])
    assert res.exit_code == 2 and res.output.startswith("gpufault: no database")
    assert not (tmp_path / "none.db").exists()


def test_every_calls_command_has_help() -> None:
    r = CliRunner()
    for args in ([], ["show"], ["live"]):
        res = r.invoke(calls, [*args, "--help"])
        assert res.exit_code == 0, args
        assert "Example" in res.output, args


def test_print_run_summary(run_db, capsys) -> None:
    p, rid, _ = run_db
    print_run_summary(str(p), rid, per_thread=False, as_json=True)
    assert json.loads(capsys.readouterr().out)["run_id"] == rid


def test_print_run_summary_gives_up_at_its_budget(run_db, capsys) -> None:
    """A zero budget interrupts the scan at SQLite's first progress check:
    one line on stderr naming the command that prints it later, no output."""
    p, rid, _ = run_db
    print_run_summary(str(p), rid, budget_s=0.0)
    out = capsys.readouterr()
    assert out.out == ""
    assert f"gpufault calls {rid}" in out.err and out.err.count("\n") == 1, out.err
    print_run_summary(str(p), rid, budget_s=60.0)  # within budget: the summary
    assert "calls" in capsys.readouterr().out


def test_in_kernel_counts_only_know_no_errors() -> None:
    """Entry-only counts see no return: a catalogued function's errors are
    unknown there, not zero; bucket percentiles are upper bounds."""
    rule = summary.error_rule("cuMemAlloc_v2", CUDA)
    f = summary.from_counts(
        summary.FuncSummary(0, "cuMemAlloc_v2", CUDA, None, rule=rule),
        calls=5,
        returns=0,
        errors=0,
        errors_by_value={},
        lat_sum=0,
        lat_max=0,
        hist=[],
    )
    s = summary.Summary(None, "kernel", False, [f], probes="entry uprobe")
    assert f.to_json()["errors"] is None and f.latency is None
    assert "  calls 5   errors -" in s.render() and "probes: entry uprobe" in s.render()
    hist = [0] * SLOTS
    hist[10] = 3  # 1024-2047 ns
    g = summary.from_counts(
        summary.FuncSummary(1, "cuInit", CUDA, None, rule=rule),
        calls=3,
        returns=3,
        errors=2,
        errors_by_value={3: 1},
        lat_sum=4000,
        lat_max=1500,
        hist=hist,
    )
    assert g.errors_by_code == {"CUDA_ERROR_NOT_INITIALIZED": 1, "other": 1}
    assert g.latency is not None and not g.latency.exact
    assert (g.latency.p50, g.latency.max) == (1500, 1500)  # bucket top 2047, capped at max


def test_a_function_with_several_names_is_shown_by_one_with_its_aliases(run_db) -> None:
    p, rid, _ = run_db
    text = summary.from_calls(_open(p), rid).render()
    # The name show, faults and metrics use, the alias beside it.
    assert "cuMemAlloc_v2 (alias cuMemAlloc)  (libcuda.so.1)" in text.splitlines()
    assert "\nfoo  (libfoo.so)" in text
