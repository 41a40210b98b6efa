"""`gpufault explore` on a real process: build/targets/gf_sites calls
gf_alloc from two sites per request; failing the cache site is tolerated,
failing the compute site breaks the error-rate SLO. Discovery must find
both sites, each trial must fire only at its own site, and the outcomes
must differ: a caller filter that leaked to the other site, or a
classification that ignored the SLO, fails this test."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from pyctl.explore import report as R
from pyctl.explore.inject import answers
from pyctl.symbols.callers import exec_range, split_site

pytestmark = [pytest.mark.root]
REPO = Path(__file__).resolve().parent.parent
SITES = REPO / "build" / "targets" / "gf_sites"
LIB = REPO / "build" / "targets" / "libgftarget.so"

FILE = """\
name = "gf-sites"
version = 1
title = "gf_sites under load"
[target]
command = ["{server}"]
[load]
rate = 20
prompt = "hello"
max_tokens = 2
timeout = "1s"
[phases]
warmup = "0.5s"
baseline = "1s"
[steady_state]
error_rate = "<= 1%"
p99 = "<= 200ms"
"""


def _gf(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyctl", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture
def sites_file(tmp_path: Path) -> Path:
    if not SITES.exists():
        pytest.skip("build/targets/gf_sites missing: run make build")
    f = tmp_path / "sites.toml"
    f.write_text(FILE.format(server=SITES))
    (tmp_path / "pins.toml").write_text('codes = ["fail:-1"]\n')
    return f


def test_caller_site_is_one_return_address() -> None:
    if not SITES.exists():
        pytest.skip("build/targets/gf_sites missing: run make build")
    p = subprocess.Popen([str(SITES)], stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        ready = p.stderr.readline()
        assert "serving on" in ready
        url = ready.split("serving on ")[1].strip()
        # what resume checks of a --pid target between trials
        assert answers(url) is None
        assert split_site(f"{SITES}+0x141e") == (str(SITES), 0x141E)
        assert split_site("libc") == ("libc", None)
        whole = exec_range(p.pid, str(SITES))
        one = exec_range(p.pid, f"{SITES}+0x141e")
        assert whole is not None and one is not None
        assert one.hi - one.lo == 1 and whole.lo <= one.lo < whole.hi
        with pytest.raises(ValueError, match="no executable mapping"):
            exec_range(p.pid, f"{SITES}+0x7fffffff")
    finally:
        p.kill()
        p.wait()
    assert "refused" in (answers(url) or "")


def test_explore_tells_the_two_sites_apart_and_resumes(sites_file: Path, tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    common = [
        "--db",
        str(db),
        "--lib",
        f"{LIB}:gf_alloc",
        "--discover-for",
        "2s",
        "--pins",
        str(tmp_path / "pins.toml"),
        "--window",
        "2s",
        "--recover",
        "1s",
    ]
    # Ctrl-C in the second trial: the first is kept, the second is not
    # recorded (it proves nothing), and resume runs it: progress is the store's.
    run = subprocess.Popen(
        [sys.executable, "-m", "pyctl", "explore", "run", str(sites_file), "-v", *common],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert run.stderr is not None
    seen = []
    for line in run.stderr:
        seen.append(line)
        if line.startswith("trial 1: "):  # its experiment has started
            break
    else:
        pytest.fail("".join(seen[-20:]))
    for line in run.stderr:  # the trial's target is up: its baseline is running
        seen.append(line)
        if line.startswith("  experiment x"):
            run.send_signal(signal.SIGINT)
            break
    out, err = run.communicate(timeout=60)
    assert run.returncode == 3, "".join(seen) + err
    con = sqlite3.connect(db)
    (xid, status, npoints) = con.execute("SELECT id, status, points FROM explorations").fetchone()
    assert status == "interrupted" and npoints == 2, (status, npoints, err[-2000:])
    sites = {s for (s,) in con.execute("SELECT site FROM explore_points")}
    assert {s.rsplit("+", 1)[0] for s in sites} == {str(SITES)}, sites
    assert con.execute("SELECT idx FROM explore_trials").fetchall() == [(0,)]
    r2 = _gf("explore", "resume", xid, "--db", str(db))
    assert r2.returncode == 1, r2.stdout + r2.stderr[-3000:]  # a trial broke the SLO
    assert con.execute("SELECT count(*), min(idx), max(idx) FROM explore_trials").fetchone() == (
        2,
        0,
        1,
    )
    assert con.execute("SELECT status FROM explorations").fetchone() == ("done",)
    xid2 = xid
    out = dict(
        con.execute(
            "SELECT function || '@' || substr(site, instr(site, '+')), outcome FROM explore_map "
            "WHERE exploration_id=?",
            (xid2,),
        ).fetchall()
    )
    # The symbols say which site is which; the offsets are the binary's.
    by_fn = {}
    for fid, site in con.execute(
        "SELECT example_fault, site FROM explore_points WHERE exploration_id=?", (xid2,)
    ):
        (sym,) = con.execute(
            "SELECT symbol FROM stacks WHERE fault_id=? AND depth=1", (fid,)
        ).fetchone()
        by_fn[sym.split("!")[1].split("+")[0]] = "gf_alloc@+" + site.rsplit("+", 1)[1]
    assert out[by_fn["cache_lookup"]] == "tolerated", out
    assert out[by_fn["compute"]] == "SLO broken", out
    # Each trial fired, and only at its own site.
    for exp_id, site in con.execute(
        "SELECT t.experiment_id, p.site FROM explore_trials t JOIN explore_points p ON "
        "p.exploration_id=t.exploration_id AND p.point=t.point WHERE t.exploration_id=?",
        (xid2,),
    ):
        (run_id,) = con.execute(
            "SELECT run_id FROM experiment_steps WHERE experiment_id=?", (exp_id,)
        ).fetchone()
        offs = {
            o
            for (o,) in con.execute(
                "SELECT DISTINCT s.offset FROM faults f JOIN stacks s ON s.fault_id=f.fault_id "
                "AND s.depth=1 WHERE f.run_id=?",
                (run_id,),
            )
        }
        assert offs == {int(site.rsplit("+", 1)[1], 16)}, (site, offs)
    rep = _gf("explore", "report", xid2, "--db", str(db), "--html", str(tmp_path / "m.html"))
    assert rep.returncode == 0, rep.stderr
    assert "**tolerated**" in rep.stdout and "**SLO broken**" in rep.stdout
    assert "gpufault experiment run " in rep.stdout
    assert "SLO broken" in (tmp_path / "m.html").read_text()
    # `experiment report EXPLORATION`: the map as a section, then each
    # trial's experiment, every map row linking to its section
    er = _gf(
        "experiment", "report", xid2, "--db", str(db),
        "-o", str(tmp_path / "e.html"), "--markdown", str(tmp_path / "e.md"),
    )  # fmt: skip
    assert er.returncode == 0, er.stdout + er.stderr
    page, md = (tmp_path / "e.html").read_text(), (tmp_path / "e.md").read_text()
    assert f"Resilience map: exploration {xid2}" in page and md.index("Resilience map") < md.index(
        "Verification matrix"
    )
    trial_exps = [e for (e,) in con.execute(
        "SELECT experiment_id FROM explore_trials WHERE exploration_id=? ORDER BY idx", (xid2,)
    )]  # fmt: skip
    assert len(trial_exps) == 2
    for e in trial_exps:
        assert f'href="#exp-{e}"' in page and f'id="exp-{e}"' in page, e
    # The same server already running, given by --pid/--url: the same map,
    # and the server is left running (a pid target is not gpufault's to stop).
    srv = subprocess.Popen([str(SITES)], stderr=subprocess.PIPE, text=True)
    try:
        assert srv.stderr is not None
        url = srv.stderr.readline().split("serving on ")[1].strip()
        # A hang at each site: every held request waits out the load's timeout.
        (tmp_path / "hang.toml").write_text('codes = ["hang"]\n')
        hang = [*common[:-6], "--pins", str(tmp_path / "hang.toml"), *common[-4:]]
        r4 = _gf(
            "explore",
            "run",
            str(sites_file),
            "--pid",
            str(srv.pid),
            "--url",
            url,
            "--stop-after",
            "1",
            *hang,
        )
        assert r4.returncode == 1, r4.stdout + r4.stderr[-3000:]
        (xid3, st3) = con.execute(
            "SELECT id, status FROM explorations WHERE id != ?", (xid2,)
        ).fetchone()
        assert st3 == "paused", st3
        r5 = _gf("explore", "resume", xid3, "--db", str(db))
        assert r5.returncode == 1, r5.stdout + r5.stderr[-3000:]
        assert srv.poll() is None
        outs = [
            o
            for (o,) in con.execute(
                "SELECT outcome FROM explore_trials WHERE exploration_id=?", (xid3,)
            )
        ]
        assert outs == ["hung", "hung"], r4.stdout
        d = _gf("explore", "diff", xid2, xid3, "--db", str(db))
        assert d.returncode == 0, d.stderr
        # the -1 trials are absent from the hang exploration and the reverse
        assert d.stdout.count("absent") == 4, d.stdout
    finally:
        srv.kill()
        srv.wait()
    # the reproduce command's file is the trial's exact spec, and it loads
    (repro,) = con.execute(
        "SELECT file FROM explore_trials WHERE exploration_id=? AND outcome='SLO broken'", (xid2,)
    ).fetchone()
    v = _gf("experiment", "validate", repro)
    assert v.returncode == 0, v.stdout + v.stderr
    js = json.loads(_gf("explore", "report", xid2, "--db", str(db), "--json").stdout)
    assert js["coverage"]["points_tried"] == 2 and js["coverage"]["calls_covered_share"] == 1.0


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "no-target.toml"
    f.write_text('name = "x"\nversion = 1\ntitle = "t"\n')
    db = tmp_path / "x.db"
    r = _gf("explore", "run", str(f), "--db", str(db))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "no [target]" in r.stderr
    assert not db.exists()
    r = _gf("explore", "report", "e00000000", "--db", str(db))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and not db.exists(), r.stderr
    # A key the loader refuses: one line naming the user's file; no database,
    # no folder of trial files.
    g = tmp_path / "bad-key.toml"
    g.write_text(FILE.format(server=SITES) + "bogus = 1\n")
    for cmd in ("run", "discover", "plan"):
        r = _gf("explore", cmd, str(g), "--db", str(db))
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert f"{g} (explore's discovery of it): steady_state.bogus" in r.stderr, r.stderr
        assert not db.exists() and not Path(str(db) + ".explore").exists()
    r = _gf("explore", "run", str(f), "--pid", "4242", "--db", str(db))
    assert r.returncode == 2 and "--pid and --url go together" in r.stderr, r.stderr
    assert not db.exists()


def test_diff_names_what_changed() -> None:
    def doc(xid: str, outcome: str) -> dict:
        return {
            "exploration": {"id": xid},
            "plan": [],
            "points": [{"point": "p1", "function": "f", "site": "/a/b+0x10"}],
            "trials": [{"point": "p1", "action": "fail", "code": "-1", "outcome": outcome}],
        }

    a, b = doc("e1", "tolerated"), doc("e2", "SLO broken")
    (row,) = R.diff(a, b)
    assert (row["site"], row["a"], row["b"]) == ("b+0x10", "tolerated", "SLO broken")
    assert row["change"] == "worse"
    assert R.diff(b, a)[0]["change"] == "better"
    # a trial that proves nothing is neither worse nor better
    assert R.diff(a, doc("e3", "not reached"))[0]["change"] == "other"
    assert "worse at 1, better at 0" in R.render_diff(a, b, R.diff(a, b))
    assert R.diff(a, a) == []
    # the map's column: a Rust entry point by its type and function
    long = (
        "<tokenizers::tokenizer::TokenizerImpl<tokenizers::models::PyModel, "
        "tokenizers::decoders::PyDecoder>>::encode_char_offsets::<tokenizers::tokenizer::EncodeInput>"
    )
    assert R.short_function(long) == "TokenizerImpl::encode_char_offsets"
    assert R.short_function("cuMemAlloc_v2") == "cuMemAlloc_v2"


SERVICE_FILE = """\
name = "svc"
version = 1
title = "the reference service on the libcuda test double"
[target]
service = { device = "cpu-double", args = ["--batch-wait", "0", "--breaker-errors", "3",
            "--breaker-cooldown", "500ms"] }
[load]
rate = 20
prompt = "hello world"
max_tokens = 4
timeout = "2s"
[phases]
baseline = "2s"
[steady_state]
error_rate = "<= 1%"
p99 = "<= 500ms"
[steady_state.probes.healthy]
kind = "http"
mode = "continuous"
url = "{url}/health"
json_path = "status"
tolerance = "ok"
interval = "250ms"
timeout = "2s"
"""


def test_the_reference_service_on_the_cpu_double(tmp_path: Path) -> None:
    """Discovery finds the double's driver calls and cuBLAS's GEMM with the
    catalog's codes; a sticky OOM at the allocation site is answered by the
    fallback (no request fails, /health says degraded): degraded within SLO."""
    f = tmp_path / "svc.toml"
    f.write_text(SERVICE_FILE)
    (tmp_path / "pins.toml").write_text(
        'pin = ["cuMemAlloc_v2", "*encode_char_offsets*"]\n'
        'codes = ["fail:CUDA_ERROR_OUT_OF_MEMORY", "stall:100ms"]\n'
    )
    db = tmp_path / "svc.db"
    r = _gf(
        "explore",
        "run",
        str(f),
        "--db",
        str(db),
        "--lib",
        "libcuda",
        "--lib",
        "libcublas",
        "--lib",
        "libnccl",
        "--lib",
        "tokenizers",
        "--discover-for",
        "3s",
        "--stall",
        "100ms",
        "--pins",
        str(tmp_path / "pins.toml"),
    )
    assert r.returncode in (0, 1), r.stdout + r.stderr[-3000:]
    con = sqlite3.connect(db)
    pts = {
        fn: json.loads(codes)
        for fn, codes in con.execute("SELECT function, codes FROM explore_points")
    }
    assert {"cuMemAlloc_v2", "cuLaunchKernel", "cublasSgemm_v2"} <= set(pts), pts
    assert pts["cuMemAlloc_v2"][0] == "fail:CUDA_ERROR_OUT_OF_MEMORY"
    assert "fail:CUBLAS_STATUS_EXECUTION_FAILED" in pts["cublasSgemm_v2"]
    # the tokenizer's encode (tok:hf-encode): one point, stalls and hangs
    # only (a Rust function has no C status to fail with)
    (enc,) = [fn for fn in pts if "encode_char_offsets" in fn]
    assert pts[enc] == ["stall:100ms", "hang"], pts[enc]
    assert "libnccl: not probed" in r.stdout, r.stdout  # the service has no NCCL
    rows = con.execute(
        "SELECT function, code, outcome, fires FROM explore_map ORDER BY idx"
    ).fetchall()
    # exit 1 exactly when a trial broke the SLO (a 100 ms stall per request
    # at the encode can; the allocation's OOM must not)
    broke = {"SLO broken", "crashed", "hung", "did not recover"}
    assert r.returncode == int(any(o in broke for _, _, o, _ in rows)), (r.returncode, rows)
    by_fn = {(fn, code): (outcome, fires) for fn, code, outcome, fires in rows}
    # the OOM at the allocation, a stall there and one at the encode
    assert len(rows) == 3, rows
    outcome, fires = by_fn[("cuMemAlloc_v2", "CUDA_ERROR_OUT_OF_MEMORY")]
    assert outcome == "degraded within SLO" and fires > 0, rows
    # the encode site is a return address inside tokenizers.abi3.so, whose
    # code is a page further in memory than in the file: the trial fires
    # only if --caller maps the frame's offset right (it was not reached)
    outcome, fires = by_fn[(enc, "100ms")]
    assert outcome != "not reached" and fires > 0, rows


def _service_exploration(tmp_path: Path, name: str, extra_args: list[str]) -> str:
    """An exploration of the reference service (its args plus extra_args)
    at the allocation and launch sites, one error code each; its id."""
    f = tmp_path / f"{name}.toml"
    f.write_text(
        SERVICE_FILE.replace(
            '"--breaker-cooldown", "500ms"]',
            '"--breaker-cooldown", "500ms"' + "".join(f', "{a}"' for a in extra_args) + "]",
        )
    )
    r = _gf(
        "explore",
        "run",
        str(f),
        "--db",
        str(tmp_path / "svc.db"),
        "--lib",
        "libcuda",
        "--discover-for",
        "3s",
        "--pins",
        str(tmp_path / "pins.toml"),
    )
    assert r.returncode in (0, 1), r.stdout + r.stderr[-3000:]
    out = r.stdout + r.stderr
    (line,) = [ln for ln in out.splitlines() if " point(s), " in ln and "planned" in ln]
    return line.split()[1].rstrip(":")


def test_a_weakened_service_shows_a_worse_map_and_the_diff_says_where(tmp_path: Path) -> None:
    """The same service with `--degrade off` (no breaker, no fallback: a
    device error is a 500) breaks the SLO at both sites where the normal
    build answers from its fallback; `diff` names both, as WORSE, and exits
    1. A weakening switch that did nothing, or a diff that compared the
    wrong keys, fails this test."""
    (tmp_path / "pins.toml").write_text(
        'pin = ["cuMemAlloc_v2", "cuLaunchKernel"]\n'
        'codes = ["fail:CUDA_ERROR_OUT_OF_MEMORY", "fail:CUDA_ERROR_LAUNCH_FAILED"]\n'
    )
    normal = _service_exploration(tmp_path, "normal", [])
    weak = _service_exploration(tmp_path, "weak", ["--degrade", "off"])
    con = sqlite3.connect(tmp_path / "svc.db")

    def outcomes(xid: str) -> dict[str, str]:
        return dict(
            con.execute(
                "SELECT function, outcome FROM explore_map WHERE exploration_id=?", (xid,)
            ).fetchall()
        )

    assert outcomes(normal) == {
        "cuMemAlloc_v2": "degraded within SLO",
        "cuLaunchKernel": "degraded within SLO",
    }, outcomes(normal)
    assert outcomes(weak) == {
        "cuMemAlloc_v2": "SLO broken",
        "cuLaunchKernel": "SLO broken",
    }, outcomes(weak)
    d = _gf("explore", "diff", normal, weak, "--db", str(tmp_path / "svc.db"))
    assert d.returncode == 1, d.stdout + d.stderr
    worse = [ln for ln in d.stdout.splitlines() if ln.endswith("WORSE")]
    assert len(worse) == 2, d.stdout
    assert any("cuMemAlloc_v2" in ln and "CUDA_ERROR_OUT_OF_MEMORY" in ln for ln in worse)
    assert any("cuLaunchKernel" in ln and "CUDA_ERROR_LAUNCH_FAILED" in ln for ln in worse)
    # the old build against the new: better, and exit 0
    back = _gf("explore", "diff", weak, normal, "--db", str(tmp_path / "svc.db"))
    assert back.returncode == 0 and "better at 2" in back.stdout, back.stdout
