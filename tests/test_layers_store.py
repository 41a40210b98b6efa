"""Every layer in one store: a tokenizer finding, a hook's fault and a
netchaos window each become a run and fault rows that `gpufault faults
--db X` lists and `gpufault show ID --db X` renders."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pyctl.cli import cli

REPO = Path(__file__).resolve().parent.parent


def gf(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return r.exit_code, r.output


def listed(db: Path) -> list[dict[str, Any]]:
    code, out = gf("faults", "--db", str(db), "--json", "--limit", "1000")
    assert code == 0, out
    return json.loads(out)


def shown(db: Path, fid: str) -> str:
    code, out = gf("show", fid, "--db", str(db))
    assert code == 0, out
    assert "no fault" not in out
    return out


def runs(db: Path) -> list[tuple[str, str, str]]:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT run_id, kind, status FROM runs ORDER BY started").fetchall()


# ---- tokenizer campaigns -------------------------------------------------------


def test_tokenizer_findings_are_faults(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken")
    db = tmp_path / "gf.db"
    code, out = gf(
        "tokenizer",
        "fuzz",
        "--target",
        "tiktoken",
        "--weaken",
        "--max-len",
        "3000",
        "--db",
        str(db),
    )
    assert code == 0, out
    ((run_id, kind, status),) = runs(db)
    assert (kind, status) == ("tokenizer:fuzz", "done")
    faults = listed(db)
    assert faults and all(f["run_id"] == run_id for f in faults)
    with sqlite3.connect(db) as c:
        cases = dict(c.execute("SELECT fault_id, outcome FROM tok_cases").fetchall())
    # Exactly the findings, each under its case's fault ID.
    found = {fid for fid, o in cases.items() if o not in ("ok", "rejected")}
    assert {f["fault_id"] for f in faults} >= found
    assert all(f["fault_id"] in cases for f in faults)
    fid = next(f["fault_id"] for f in faults if cases[f["fault_id"]] == "exception")
    out = shown(db, fid)
    assert f"fault {fid}" in out and "tiktoken.Encoding.encode" in out
    assert "input via in-process" in out
    assert "IndexError" in out and "sha256" in out
    code, js = gf("show", fid, "--db", str(db), "--json")
    doc = json.loads(js)
    assert doc["fault"]["outcome"]["result"] == "exception" and doc["case"]["fault_id"] == fid


def test_tokenizer_injected_corruption_is_a_corrupt_fault(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    db = tmp_path / "gf.db"
    code, out = gf(
        "tokenizer", "truncation", "--target", "hf", "--corrupt", "mask-flip", "--db", str(db)
    )
    assert code == 0, out
    faults = listed(db)
    assert faults and {f["action"] for f in faults} == {"corrupt"}
    assert {f["function"] for f in faults} == {"collate"}
    assert "corrupt via in-process" in shown(db, faults[0]["fault_id"])


# ---- hooks -----------------------------------------------------------------------


def test_vram_pressure_hold_is_a_fault(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    code, out = gf(
        "hooks",
        "vram-pressure",
        "--share",
        "0.5",
        "--duration",
        "0.3",
        "--allocator",
        "host-double",
        "--db",
        str(db),
    )
    assert code == 0, out
    ((run_id, kind, status),) = runs(db)
    assert (kind, status) == ("hooks:vram-pressure", "done")
    (f,) = listed(db)
    assert (f["fault_id"], f["function"], f["action"]) == (f"{run_id}-1", "vram-hold", "pressure")
    out = shown(db, f["fault_id"])
    assert "pressure via vram-hold" in out and "share" in out and "bytes_held" in out
    assert "nvml_used_after" in out and "test double" in out and " s)" in out


def test_vram_pressure_sigterm_releases_and_ends_the_window(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pyctl",
            "hooks",
            "vram-pressure",
            "--share",
            "0.25",
            "--duration",
            "60",
            "--allocator",
            "host-double",
            "--db",
            str(db),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    assert json.loads(p.stdout.readline())["event"] == "holding"
    p.send_signal(signal.SIGTERM)  # to gpufault alone: it hands it to the holder
    assert p.wait(timeout=30) == 0
    (f,) = listed(db)
    doc = json.loads(gf("show", f["fault_id"], "--db", str(db), "--json")[1])
    assert doc["fault"]["outcome"]["reason"] == "signal:SIGTERM"
    assert doc["fault"]["latency_ns"] < 30e9
    assert [s for _, _, s in runs(db)] == ["done"]


def test_vram_pressure_bad_input_leaves_no_database(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    code, _ = gf("hooks", "vram-pressure", "--share", "2", "--duration", "1", "--db", str(db))
    assert code == 2 and not db.exists()


def test_tc_measure_flips_are_faults(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    db = tmp_path / "gf.db"
    code, out = gf("hooks", "tc-measure", "--as", "fp16", "--bits", "sign", "--db", str(db))
    assert code == 0, out
    ((_, kind, _),) = runs(db)
    assert kind == "hooks:tc-measure"
    faults = listed(db)
    assert len(faults) > 3 and all(f["action"] == "bitflip" for f in faults)
    doc = json.loads(gf("show", faults[0]["fault_id"], "--db", str(db), "--json")[1])
    o = doc["fault"]["outcome"]
    assert o["bits"] == "sign" and o["rate"] == 1e-3 and o["bits_flipped"] > 0
    assert doc["fault"]["function"] == faults[0]["function"]  # the layer
    assert "bitflip via torch-hook" in shown(db, faults[0]["fault_id"])


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None or shutil.which("make") is None:
        pytest.skip("needs a C compiler and make (apt-get install gcc make)")
    d = tmp_path_factory.mktemp("gfpreload")
    subprocess.run(["make", "-s", "-C", str(REPO / "pyctl/hooks/preload"), f"OUT={d}"], check=True)
    return d


def test_preload_fires_are_faults(shim: Path, tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    rules = "cuMemAlloc_v2:nth=3:ret=2;cuLaunchKernel:every=7:ret=719"
    app = str(shim / "double/gfp-app")
    code, out = gf(
        "hooks",
        "preload",
        rules,
        "--so",
        str(shim / "gfpreload.so"),
        "--db",
        str(db),
        "--",
        app,
        "direct",
        "14",
    )
    assert code == 0, out
    ((run_id, kind, status),) = runs(db)
    assert (kind, status) == ("hooks:preload", "done")
    got = sorted((f["function"], f["ret"]) for f in listed(db))
    assert got == [("cuLaunchKernel", 719), ("cuLaunchKernel", 719), ("cuMemAlloc_v2", 2)]
    fid = next(f["fault_id"] for f in listed(db) if f["function"] == "cuMemAlloc_v2")
    out = shown(db, fid)
    assert "cuMemAlloc_v2 #3" in out and "fail via ld-preload" in out


def test_preload_import_of_a_log(tmp_path: Path) -> None:
    db, log = tmp_path / "gf.db", tmp_path / "inj.jsonl"
    log.write_text(
        '{"ts_ns":1,"pid":7,"tid":8,"func":"cuMemAlloc_v2","via":"direct","call":3,'
        '"fire":1,"ret":2}\n{"torn'
    )
    code, out = gf(
        "hooks", "preload-import", str(log), "--rules", "cuMemAlloc_v2:nth=3", "--db", str(db)
    )
    assert code == 0, out
    (f,) = listed(db)
    assert (f["function"], f["pid"], f["tid"], f["call_seq"]) == ("cuMemAlloc_v2", 7, 8, 3)


# ---- netchaos --------------------------------------------------------------------


def needs_root(fn: Any) -> Any:
    pytest.importorskip("pyroute2")
    return pytest.mark.root(
        pytest.mark.skipif(os.geteuid() != 0, reason="requires root (netns, tc, bpf)")(fn)
    )


def _start_link(db: Path) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [sys.executable, "-m", "pyctl", "netchaos", "link", "--duration", "60", "--db", str(db)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    first = p.stdout.readline()
    assert first.startswith("link gf"), p.stderr.read() if p.stderr else first
    assert [p.stdout.readline().split()[0] for _ in "ab"] == ["a", "b"]
    return p, first.split()[1]


def _stop(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=30) == 0


@needs_root
def test_netchaos_windows_are_faults(tmp_path: Path) -> None:
    from pyctl import netchaos

    db = tmp_path / "gf.db"
    p, name = _start_link(db)
    try:
        assert gf("netchaos", "partition", "--link", name, "--for", "0.3s", "--db", str(db))[0] == 0
        assert (
            gf(
                "netchaos",
                "loss",
                "5%",
                "--link",
                name,
                "--direction",
                "a2b",
                "--for",
                "0.2s",
                "--db",
                str(db),
            )[0]
            == 0
        )
        code, out = gf(
            "netchaos", "rate", "1mbit", "--link", name, "--for", "0.2s", "--db", str(db)
        )
        assert code == 0, out
        if not netchaos.netem_available():
            code, out = gf(
                "netchaos", "delay", "20ms", "--link", name, "--for", "1s", "--db", str(db)
            )
            assert code == 2 and "sch_netem" in out and out.count("\n") == 1
        # Everything undone: the next window finds a clean link.
        link = netchaos.Link.attach(name)
        link.close()
    finally:
        _stop(p)
    kinds = [k for _, k, _ in runs(db)]
    assert kinds[:4] == ["netchaos:link", "netchaos:partition", "netchaos:loss", "netchaos:rate"]
    assert len(kinds) == 4  # the refused delay left no run
    faults = {f["action"]: f for f in listed(db)}
    assert set(faults) == {"partition", "loss", "rate"}
    part = json.loads(gf("show", faults["partition"]["fault_id"], "--db", str(db), "--json")[1])
    o = part["fault"]["outcome"]
    assert o["direction"] == "both" and o["ended_by"] == "duration"
    assert 0.3e9 <= part["fault"]["latency_ns"] < 5e9
    loss = json.loads(gf("show", faults["loss"]["fault_id"], "--db", str(db), "--json")[1])
    assert loss["fault"]["outcome"]["loss_pct"] == pytest.approx(5)
    out = shown(db, faults["rate"]["fault_id"])
    assert "rate via tc" in out and "rate_mbit" in out and f"in {name}" in out


@needs_root
def test_netchaos_partition_until_sigint_is_undone(tmp_path: Path) -> None:
    from pyroute2 import IPRoute

    db = tmp_path / "gf.db"
    p, name = _start_link(db)
    try:
        q = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pyctl",
                "netchaos",
                "partition",
                "--link",
                name,
                "--db",
                str(db),
            ],
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert q.stderr is not None
        assert "Ctrl-C lifts it" in q.stderr.readline()
        q.send_signal(signal.SIGINT)
        assert q.wait(timeout=30) == 0
        ns = next(f"/run/netns/{n}" for n in os.listdir("/run/netns") if n.endswith(name[2:] + "a"))
        with IPRoute(netns=os.path.basename(ns)) as ipr:
            kinds = {x.get_attr("TCA_KIND") for x in ipr.get_qdiscs()}
        assert "clsact" not in kinds
    finally:
        _stop(p)
    (f,) = listed(db)
    doc = json.loads(gf("show", f["fault_id"], "--db", str(db), "--json")[1])
    assert doc["fault"]["outcome"]["ended_by"] == "SIGINT"
    assert [s for _, k, s in runs(db) if k == "netchaos:partition"] == ["interrupted"]


def test_netchaos_bad_values_are_one_line(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    for args in (["rate", "1zb"], ["loss", "150%"], ["delay", "soon"], ["rate", "100000gbit"]):
        r = subprocess.run(
            [sys.executable, "-m", "pyctl", "netchaos", *args, "--db", str(db)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and r.stderr.startswith("gpufault: "), (args, r.stderr)
        assert r.stderr.count("\n") == 1 and not r.stdout, (args, r.stderr)
    assert not db.exists()
