"""Fault templates: the shipped files, the loader, the CLI, and real runs
against the libcuda TEST DOUBLE's workload (pyctl/data/doubles/gf-infer)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pyctl import paths
from pyctl import templates as T
from pyctl.cli import cli

REPO = Path(__file__).resolve().parent.parent
INFER = paths.DOUBLE_INFER
CLASSES = {1, 2, 3, 6, 7, 8}


def test_every_class_has_a_template_and_all_expand_with_defaults() -> None:
    ts = T.all_templates()
    assert {t.klass for t in ts.values()} == CLASSES
    for t in ts.values():
        specs = t.specs()
        assert specs and all(s.action in ("fail", "stall") for s in specs), t.name
        assert t.version >= 1 and t.title and t.description
        used = " ".join(str(v) for f in t.faults for v in f.values())
        for k in t.knobs:  # every knob does something
            assert "{" + k + "}" in used, f"{t.name}: knob {k} unused"


def test_knobs_override_and_are_typed() -> None:
    t = T.get("cuda-oom-sticky")
    [s] = t.specs({"after": "0x10", "sticky": "false", "min_bytes": "200M"})
    assert (s.after, s.sticky, s.pred) == (16, False, (2, s.pred[1], 200 << 20))
    assert s.ret == 2 and s.action == "fail" and s.mode == "skip"
    [leak] = T.get("cuda-oom-leak").specs()
    assert leak.mode == "after" and leak.max_fires == 3
    [stall] = T.get("nccl-rank-stall").specs()
    assert stall.stall_ms == 5.0 and stall.prob_ppm == 50_000
    [g] = T.get("cublas-gemm-exec-failed").specs()
    assert g.ret == 13 and g.every == 7


def test_enabled_knob_adds_faults() -> None:
    t = T.get("cuda-managed-fail")
    assert len(t.specs()) == 1
    specs = t.specs({"prefetch": "yes", "advise": "1"})
    assert [s.fn for s in specs] == ["cuMemAllocManaged", "cuMemPrefetchAsync*", "cuMemAdvise*"]


@pytest.mark.parametrize(
    "sets, msg",
    [
        ({"nope": "1"}, "no knob 'nope'"),
        ({"after": "lots"}, "not a number"),
        ({"sticky": "maybe"}, "use true or false"),
    ],
)
def test_bad_knob_values_are_one_line_errors(sets: dict[str, str], msg: str) -> None:
    with pytest.raises(T.TemplateError, match=msg):
        T.get("cuda-oom-sticky").specs(sets)


def test_version_pin_and_unknown_name() -> None:
    assert T.get("cuda-oom-sticky@v1").version == 1
    with pytest.raises(T.TemplateError, match="not 9"):
        T.get("cuda-oom-sticky@v9")
    with pytest.raises(T.TemplateError, match="gpufault template list"):
        T.get("no-such-template")


def test_user_directory_template_and_its_validation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = tmp_path / "mine.toml"
    good.write_text(
        'name = "mine"\nversion = 2\nclass = 1\ntitle = "t"\ndescription = "d"\n'
        '[knobs.n]\ndefault = 4\nhelp = "h"\n'
        '[[fault]]\nlib = "libc"\nfn = "malloc"\naction = "fail"\nret = 0\n'
        'nth = "{n}"\n'
    )
    monkeypatch.setenv(T.ENV_DIRS, str(tmp_path))
    assert T.get("mine").specs()[0].nth == 4
    (tmp_path / "bad.toml").write_text(
        'name = "bad"\nversion = 1\nclass = 1\ntitle = "t"\n'
        'description = "d"\n[[fault]]\nlib = "x"\nfn = "{k}"\n'
    )
    with pytest.raises(T.TemplateError, match=r"\{k\} used but no \[knobs.k\]"):
        T.get("bad")
    (tmp_path / "bad.toml").write_text('name = "other"\nversion = 1\n')
    with pytest.raises(T.TemplateError, match="needs class|match the file"):
        T.get("bad")


def test_cli_list_and_show() -> None:
    r = CliRunner().invoke(cli, ["template", "list"])
    assert r.exit_code == 0 and "cuda-oom-sticky" in r.output and "class 8" in r.output
    r = CliRunner().invoke(
        cli, ["template", "show", "cublas-gemm-exec-failed", "--set", "every=11"]
    )
    assert r.exit_code == 0 and "every=11" in r.output and "knobs" in r.output


def gf(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        **kw,
    )


def test_cli_bad_input_one_line_exit_2(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    for args in (
        ["template", "run", "nope", "--pid", "1"],
        ["template", "run", "cuda-oom-sticky", "--set", "after=x", "--pid", "1"],
        ["template", "run", "cuda-oom-sticky", "--set", "after"],
    ):
        r = gf(*args, "--db", str(db))
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) <= 3 and "Traceback" not in r.stderr
    assert not db.exists()


needs_double = pytest.mark.skipif(not INFER.exists(), reason=paths.hint(INFER))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="requires root (BPF, ptrace)")


def run_on_double(name: str, db: Path, knob: str, steps: int) -> subprocess.CompletedProcess[str]:
    """`gpufault template run NAME --set KNOB -- gf-infer --threads 1 --steps STEPS`."""
    return gf(
        "template", "run", name, "--db", str(db), "-q", "--set", knob,
        "--", str(INFER), "--threads", "1", "--steps", str(steps),
    )  # fmt: skip


@pytest.mark.root
@needs_root
@needs_double
def test_run_oom_sticky_on_the_double(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    r = run_on_double("cuda-oom-sticky", db, "after=3", steps=6)
    # gf-infer exits 1 when a CUDA call failed; it reports each one.
    assert r.returncode == 1, r.stderr
    assert r.stdout.count("cuMemAlloc_v2 -> CUDA_ERROR_OUT_OF_MEMORY (2)") == 3
    con = sqlite3.connect(db)
    assert [x[0] for x in con.execute("SELECT call_seq FROM faults ORDER BY call_seq")] == [4, 5, 6]
    assert con.execute("SELECT kind FROM runs").fetchone()[0] == "template:cuda-oom-sticky@v1"


@pytest.mark.root
@needs_root
@needs_double
def test_run_launch_failed_and_ctx_destroyed_on_the_double(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    r = run_on_double("cuda-launch-failed", db, "nth=2", steps=4)
    assert r.returncode == 1 and "cuLaunchKernel -> CUDA_ERROR_LAUNCH_FAILED (719)" in r.stdout
    r = run_on_double("cuda-ctx-destroyed", db, "after=2", steps=4)
    assert r.returncode == 1
    assert r.stdout.count("cuStreamSynchronize -> CUDA_ERROR_CONTEXT_IS_DESTROYED (709)") == 2
    con = sqlite3.connect(db)
    assert con.execute("SELECT count(*) FROM faults").fetchone()[0] == 3
