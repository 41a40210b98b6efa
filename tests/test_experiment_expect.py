"""Expected verdicts (issue 23): a file says which verdict it ends in by
design ([expect] verdict), a run that gets it exits 0 and says so, any
other is a surprise; `experiment run --all` runs the whole set and exits
non-zero only on a surprise; a file that needs a GPU the host lacks is
refused (one run) or skipped (--all) before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyctl.experiment import load as F
from pyctl.experiment import model as M
from pyctl.experiment.target import host_has_gpu
from pyctl.experiment.verdict import expectation_words, expected_exit

REPO = Path(__file__).resolve().parent.parent
GF_EXP = [sys.executable, "-m", "pyctl", "experiment"]
CONTROL = F.find("control").read_text()
HEADER = ["experiment", "verdict", "expected", "outcome"]


def _file(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(text.replace('name = "control"', f'name = "{name}"', 1))
    return p


def test_the_exit_status_a_file_that_expects_its_verdict_gets() -> None:
    table = {
        ("pass", "pass"): 0, ("fail", "fail"): 0, ("aborted", "aborted"): 0,
        ("error", "error"): 0, ("fail", "pass"): 1, ("pass", "fail"): 1,
        ("error", "fail"): 2, ("aborted", "fail"): 3, ("aborted", "pass"): 3,
    }  # fmt: skip
    for (got, want), rc in table.items():
        assert expected_exit(got, want) == rc, (got, want)
    # A signal's abort is never what a file expected, even an aborting one.
    assert expected_exit("aborted", "aborted", interrupted=True) == 3
    # A target's death the file does not allow is a surprise, not its fail.
    assert expected_exit("fail", "fail", died=True) == 1
    assert expectation_words("pass", "pass") == ""
    assert expectation_words("fail", "pass") == ""  # the usual file reads as it did
    assert expectation_words("fail", "fail") == " (expected)"
    assert expectation_words("pass", "fail") == " (expected FAIL: a surprise)"
    assert expectation_words("fail", "fail", died=True) == " (expected FAIL: a surprise)"


def _expect_block(verdict: str) -> str:
    return CONTROL.replace("[expect]\n", f"[expect]\nverdict = {verdict}\n", 1)


def test_expect_verdict_is_a_word_or_a_table_by_device(tmp_path: Path) -> None:
    assert F.load_file(_file(tmp_path, "a", CONTROL)).expect.verdict == "pass"
    assert F.load_file(_file(tmp_path, "b", _expect_block('"fail"'))).expect.verdict == "fail"
    by_device = _expect_block('{ cpu = "fail", default = "pass" }')
    assert F.load_file(_file(tmp_path, "c", by_device)).expect.verdict == "fail"
    other = by_device.replace('device = "cpu"', 'device = "cpu-double"', 1)
    assert F.load_file(_file(tmp_path, "d", other)).expect.verdict == "pass"
    # The shipped ones that end other than pass by design say so.
    assert F.load("tokenizer-stall").expect.verdict == "fail"
    assert F.load("worker-hang-abort").expect.verdict == "aborted"
    assert F.load("cuda-oom-leak-held").expect.verdict == "fail"  # on the double
    assert F.load("cuda-oom-leak-held", {"device": "cuda"}).expect.verdict == "pass"
    # The one whose finding is that the service aborts says it may die.
    assert F.load("cuda-corrupt-xid-linked").expect.target_may_die
    assert not F.load("tokenizer-stall").expect.target_may_die


@pytest.mark.parametrize(
    "value", ['"maybe"', "1", '{ cpu = "ok" }', "{}"], ids=["word", "number", "table", "empty"]
)
def test_a_bad_expected_verdict_is_one_line(tmp_path: Path, value: str) -> None:
    with pytest.raises(M.ExperimentError) as e:
        F.load_file(_file(tmp_path, "bad", _expect_block(value)))
    assert "expect.verdict: expected one of 'pass' / 'fail' / 'error' / 'aborted'" in str(e.value)
    assert "\n" not in str(e.value)


def test_what_a_target_needs_of_the_host(tmp_path: Path) -> None:
    assert F.load("cuda-corrupt-xid-linked").target.needs_gpu  # its service on cuda
    assert not F.load("control").target.needs_gpu
    assert not F.load("cuda-oom-degrade").target.needs_gpu  # the CPU double
    needs = CONTROL.replace("[target]\n", '[target]\nrequires = ["gpu"]\n', 1)
    assert F.load_file(_file(tmp_path, "g", needs)).target.needs_gpu
    bad = CONTROL.replace("[target]\n", '[target]\nrequires = ["tpu"]\n', 1)
    with pytest.raises(M.ExperimentError, match=r"target.requires: expected a list of 'gpu'"):
        F.load_file(_file(tmp_path, "t", bad))


def _gf(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GF_EXP, "run", *args], cwd=REPO, capture_output=True, text=True, timeout=240,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.skipif(host_has_gpu(), reason="checks the refusal on a host without a GPU")
def test_all_skips_what_needs_a_gpu_with_one_line_and_bad_input_is_refused(
    tmp_path: Path,
) -> None:
    db = tmp_path / "gf.db"
    p = _gf("--all", "--match", "cuda-corrupt-*", "--db", str(db))
    assert p.returncode == 0, p.stdout + p.stderr
    assert (
        "== cuda-corrupt-xid-linked: skipped: needs a GPU (its service runs on cuda) "
        "and this host has none" in p.stdout
    ), p.stdout
    assert (
        p.stdout.strip()
        .splitlines()[-1]
        .startswith("0 run, 0 as expected, 0 surprise(s), 1 skipped")
    )
    assert not db.exists()
    for args, line in (
        (["--all", "--set", "nosuch=1"], "--set nosuch: no experiment here has that knob"),
        (["control", "--all"], "--all runs every experiment"),
        (["--match", "control"], "--all runs every experiment"),
        ([], "give an experiment NAME"),
        (["--all", "--match", "nosuch*"], "--match nosuch*: no experiment of that name"),
    ):
        p = _gf(*args, "--db", str(db))
        assert p.returncode == 2 and line in p.stderr, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not db.exists()


def test_a_surprise_exits_non_zero_and_the_expected_exits_0(tmp_path: Path) -> None:
    """control passes; a copy that expects an error is a surprise (exit 1);
    --all over both says which, and exits 1 for the one surprise."""
    d = tmp_path / "mine"
    d.mkdir()
    # Expects an error: whatever control ends in here (a pass, or a fail
    # on a burst of this shared machine), it is a surprise.
    _file(d, "surprised-control", _expect_block('"error"'))
    env = {"GPUFAULT_EXPERIMENTS": str(d)}
    db = tmp_path / "gf.db"
    loose = ("--set", "p99=2s")  # the mechanics, not this busy machine's latency
    p = _gf(str(d / "surprised-control.toml"), *loose, "--db", str(db))
    out = p.stdout + p.stderr
    if "steady state not met before the method" in out:  # a burst on the shared machine
        pytest.skip("the machine broke the steady state before the method")
    assert p.returncode == 1, out
    assert "(expected ERROR: a surprise)" in out, out
    p = _gf("--all", "--match", "*control", *loose, "--db", str(db), env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    lines = out.strip().splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split() == HEADER)
    rows = {ln.split()[0]: ln.split(None, 3)[1:] for ln in lines[head + 1 : -1]}
    if rows["control"][0] != "PASS":
        pytest.skip(f"control ended {rows['control'][0]} on this busy machine")
    assert rows["control"] == ["PASS", "PASS", "as expected"], rows
    assert rows["surprised-control"][1:] == ["ERROR", "SURPRISE"], rows
    assert lines[-1].startswith("2 run, 1 as expected, 1 surprise(s), 0 skipped"), lines[-1]
