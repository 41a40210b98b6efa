"""`show`, `faults` in words: event rows -> store -> text, no root, no BPF.

The rows are what the engine writes (tests/evidence_rows.py); the text is
what a person reads: outcomes as sentences, codes and signals by name,
addresses in hex, no JSON. --json stays the complete record."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from evidence_rows import fill, gf

from pyctl.api import reading
from pyctl.bpf import abi
from pyctl.evidence import query, store, words


def test_copilot_fail_reads_as_a_sentence(evidence: dict) -> None:
    rc, out = gf("show", evidence["faults"][0], "--db", evidence["db"])
    assert rc == 0, out
    assert (
        "outcome   copilot: stopped 5.1 ms, injected CUDA_ERROR_OUT_OF_MEMORY (2), "
        "resumed at the return address"
    ) in out
    assert "action    fail via copilot, injected CUDA_ERROR_OUT_OF_MEMORY (2)" in out
    assert "returned  CUDA_ERROR_OUT_OF_MEMORY (2) after 5.1 ms" in out
    assert "cuMemAlloc_v2 returned CUDA_ERROR_OUT_OF_MEMORY (2)" in out  # the link
    assert "2.0 ms after the fault" in out
    assert "[record 9]" in out  # the anchor's own record number


def test_corrupt_and_signal_read_as_words(evidence: dict) -> None:
    _, out = gf("show", evidence["faults"][1], "--db", evidence["db"])
    assert "outcome   corrupted 8 bytes at 0x7ffd12345678 (zeroed)" in out
    _, out = gf("show", evidence["faults"][2], "--db", evidence["db"])
    assert "outcome   sent SIGSEGV (11)" in out
    assert "SIGSEGV (11), si_code 1: injected signal" in out
    assert "killed by SIGSEGV (11) (core dumped)" in out


def test_no_json_and_no_signed_decimal_addresses_in_text(evidence: dict) -> None:
    _, out = gf("show", evidence["run"], "--db", evidence["db"])
    assert "{" not in out and '"' not in out, out
    # ax = -1 and a kernel-half return address: unsigned hex, never "-1".
    assert "ax=0xffffffffffffffff" in out and "0xffff7f7379659a00" in out
    assert not re.search(r"-\d{6,}", out), out


def test_show_run_shows_every_fault_in_fire_order(evidence: dict) -> None:
    _, out = gf("show", evidence["run"], "--db", evidence["db"])
    assert re.findall(r"^fault (\S+)", out, re.M) == evidence["faults"]
    rc, js = gf("show", evidence["run"], "--json", "--db", evidence["db"])
    docs = json.loads(js)
    assert rc == 0 and [d["fault"]["fault_id"] for d in docs] == evidence["faults"]


def test_show_latest_is_the_newest_fault(evidence: dict) -> None:
    _, out = gf("show", "latest", "--db", evidence["db"])
    assert out.startswith(f"fault {evidence['faults'][2]} ")


def test_show_json_stays_complete(evidence: dict) -> None:
    rc, js = gf("show", evidence["faults"][0], "--json", "--db", evidence["db"])
    doc = json.loads(js)
    assert set(doc) >= {
        "fault",
        "spec",
        "spec_json",
        "registers",
        "args",
        "stack",
        "links",
        "anchors",
        "xids",
        "experiment",
    }
    assert doc["fault"]["outcome"]["copilot"]["ret_addr"] == 0x55550000ABCD
    assert doc["registers"]["ax"] == 2**64 - 1  # unsigned
    assert doc["stack"][0]["address"] == 0xFFFF7F7379659A00
    (link,) = doc["links"]
    assert link["detail"] == {"func": 0, "ret": 2} and link["function"] == "cuMemAlloc_v2"


def test_show_unknown_is_one_line_exit_2(evidence: dict) -> None:
    rc, out = gf("show", "nope-1", "--db", evidence["db"])
    assert rc == 2 and out.count("\n") == 1 and out.startswith("gpufault: no fault nope-1")


def test_faults_columns_and_filters(evidence: dict) -> None:
    rc, out = gf("faults", "--db", evidence["db"])
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:4] == ["FAULT", "TIME", "LIBRARY", "FUNCTION"]
    # into a pipe: the full ids (host part and random half), 8 columns more
    assert {ln.split()[0] for ln in lines[1:]} == set(evidence["faults"])
    assert all(len(ln) <= 88 for ln in lines), lines
    # on a terminal: 80 columns, one node's faults by their short ids, which
    # `show` takes back
    rows, _ = reading.fault_list(store.open_db(evidence["db"]))
    term = reading.render_faults(rows, cut=True).splitlines()
    assert all(len(ln) <= 80 for ln in term), term
    short = {ln.split()[0] for ln in term[1:]}
    assert short == {f[8:] for f in evidence["faults"]}
    for sid in short:
        rc, shown = gf("show", sid, "--db", evidence["db"], "--json")
        assert rc == 0 and json.loads(shown)["fault"]["fault_id"] == evidence["run"] + sid[8:]
    assert "libcuda.so.1" in out and re.search(r"\d\d:\d\d:\d\d", lines[1])
    _, out = gf("faults", "--function", "cuMem*", "--db", evidence["db"])
    assert [ln.split()[0] for ln in out.splitlines()[1:]] == [evidence["faults"][0]]
    _, out = gf("faults", "--function", "m*", "--run", evidence["run"], "--db", evidence["db"])
    assert len(out.splitlines()) == 3  # memset, malloc
    _, out = gf("faults", "--since", "1h", "--db", evidence["db"])
    assert len(out.splitlines()) == 4
    _, out = gf("faults", "--since", "2999-01-01T00:00", "--db", evidence["db"])
    assert out.strip() == "no faults recorded that match"
    rc, out = gf("faults", "--since", "yesterday", "--db", evidence["db"])
    assert rc == 2 and "--since" in out and "ISO time" in out


def test_not_injected_is_never_injected(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    fill(db)
    con = store.open_db(db)
    with con.conn:
        con.conn.execute(
            "UPDATE faults SET outcome = ?, ret = NULL WHERE seq = 1",
            (json.dumps({"injected": False, "error": "no copilot stop was seen"}),),
        )
    (fid,) = con.conn.execute("SELECT fault_id FROM faults WHERE seq = 1").fetchone()
    text = query.render_chain(query.fault_chain(con, fid))
    con.close()
    assert "NOT injected: no copilot stop was seen" in text
    assert "injected CUDA" not in text


def test_words_helpers() -> None:
    assert words.hexaddr(-1) == "0xffffffffffffffff"
    assert words.signal_name(11) == "SIGSEGV (11)"
    assert words.signal_name(34 + 2) == "SIGRTMIN+2 (36)"
    assert words.code_name("cuMemAlloc_v2", "libcuda.so.1", 2) == "CUDA_ERROR_OUT_OF_MEMORY (2)"
    assert words.code_name("malloc", "libc.so.6", 2) == "2"
    stall = {"copilot": {"action": abi.ACT_STALL, "stop_ns": 10, "resume_ns": 5_000_010}}
    assert words.outcome_words({"outcome": stall}) == ["copilot: held the thread 5.0 ms, released"]
    err = {
        "copilot": {"action": abi.ACT_FAIL, "stop_ns": 1, "resume_ns": 2, "error": "boom"},
        "injected": False,
    }
    assert words.outcome_words({"outcome": err, "retval": 2}) == [
        "copilot: stopped 1 ns, NOT injected: boom"
    ]


def test_probes_shows_aliases_beside_the_name() -> None:
    from pyctl.paths import DOUBLE_LIBCUDA as lib

    if not lib.exists():
        pytest.skip("the libcuda test double is not built (make build)")
    rc, out = gf("probes", str(lib), "--fn", "cuMemAlloc*")
    assert rc == 0, out
    line = next(ln for ln in out.splitlines() if "cuMemAlloc_v2" in ln)
    assert "cuMemAlloc = cuMemAlloc_v2" in line or "cuMemAlloc_v2 = cuMemAlloc" in line


def test_the_banner_names_the_mechanism_really_used() -> None:
    # A trace needs no ptrace: the start-up line says bpf, not copilot.
    from pyctl.engine.mechanism import Plan
    from pyctl.spec import FaultSpec

    def mech(regs: bool, writes: bool, **kw: object) -> str:
        return Plan([FaultSpec(lib="libc", fn="getpid", **kw)], regs, writes).mechanism  # type: ignore[arg-type]

    assert mech(False, False, action="observe", trace=True) == "bpf"
    assert mech(False, False, action="signal", signo=11) == "bpf"
    assert mech(True, True, action="corrupt", corrupt=(1, 0, 0, 0, 8)) == "bpf"
    assert mech(True, False, action="fail", ret=2) == "regs"
    assert mech(False, False, action="fail", ret=2) == "copilot"
    assert mech(True, True, action="stall", stall_ms=5.0) == "copilot"


def test_loss_causes_in_words_name_each_nonzero_cause_in_order() -> None:
    why = {"ring_full": 21, "room_when_read": 9, "backlog_max_bytes": 67108800}
    assert words.loss_words(why) == (
        "ring full 21, room when looked at 9"
    )
    assert words.loss_words({}) == words.loss_words(None) == ""
