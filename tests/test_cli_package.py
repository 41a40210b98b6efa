"""pyctl/cli/: every command's help and options, the value types, --db and
GPUFAULT_DB, completion, the man page, doctor's marks, the one spec builder.

No root, no BPF: commands are parsed (make_context) or run where they only
read; the runs themselves are tests/test_cli.py's."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pyctl.cli import cli, completion, main
from pyctl.cli import options as O
from pyctl.cli.commands import COMMANDS
from pyctl.cli.doctor import mark
from pyctl.cli.man import render, roff_escape
from pyctl.evidence import store
from pyctl.run_options import RunOptions
from pyctl.spec import FaultSpec, ReturnCode, SpecError

REPO = Path(__file__).resolve().parent.parent


def _walk(group: click.Group, path: list[str]) -> list[tuple[list[str], click.Command]]:
    out = []
    for name, cmd in sorted(group.commands.items()):
        out.append(([*path, name], cmd))
        if isinstance(cmd, click.Group):
            out += _walk(cmd, [*path, name])
    return out


ALL = _walk(cli, [])


@pytest.mark.parametrize("path, cmd", ALL, ids=[" ".join(p) for p, _ in ALL])
def test_every_command_help_shows_its_options(path: list[str], cmd: click.Command) -> None:
    res = CliRunner().invoke(cli, [*path, "--help"], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert cmd.help and cmd.help.strip(), f"{' '.join(path)} has no help text"
    for p in cmd.params:
        if isinstance(p, click.Option) and not p.hidden:
            assert max(p.opts, key=len) in res.output, (path, p.opts)
            assert p.help, f"{' '.join(path)} {p.opts[0]} has no help"


def test_tc_measure_help_lists_the_hooks_options() -> None:
    # Its options belong to the child's parser; they are declared for --help too.
    res = CliRunner().invoke(cli, ["hooks", "tc-measure", "--help"])
    for opt in ("--model-dtype", "--as", "--rate", "--matmul", "--json"):
        assert opt in res.output


def test_every_registered_group_imports() -> None:
    names = {c.name for _, c in ALL if len(_) == 1}
    for ref in COMMANDS:
        module, attr = ref.split(":")
        cmd = getattr(__import__(module, fromlist=[attr]), attr)
        assert cmd.name in names, ref


# ---- value types ------------------------------------------------------------


def _conv(t: click.ParamType, text: str) -> object:
    return t.convert(text, None, None)


@pytest.mark.parametrize(
    "text, secs", [("30s", 30), ("500ms", 0.5), ("1m30s", 90), ("2h", 7200), ("90", 90)]
)
def test_duration(text: str, secs: float) -> None:
    assert _conv(O.DURATION, text) == pytest.approx(secs)


def test_bad_values_are_usage_errors_naming_the_option() -> None:
    opt = click.Option(["--duration"], type=O.DURATION)
    with pytest.raises(click.BadParameter) as e:
        O.DURATION.convert("1m30", opt, None)
    assert e.value.format_message().startswith("--duration: '1m30' is not a duration")
    for t, bad in ((O.SIZE, "-1"), (O.SIZE, "lots"), (O.PROBABILITY, "200%"),
                   (O.SIGNAL, "SIG_IGN"), (O.CODE, "1.5")):  # fmt: skip
        with pytest.raises(click.BadParameter):
            _conv(t, bad)


def test_size_probability_signal_code() -> None:
    assert _conv(O.SIZE, "64M") == 64 << 20 and _conv(O.SIZE, "1GiB") == 1 << 30
    assert _conv(O.SIZE, "0") == 0
    assert _conv(O.PROBABILITY, "5%") == pytest.approx(0.05)
    assert _conv(O.PROBABILITY, "0.05") == pytest.approx(0.05)
    assert _conv(O.SIGNAL, "SIGUSR1") == _conv(O.SIGNAL, "USR1") == _conv(O.SIGNAL, "10") == 10
    assert _conv(O.CODE, "0x10") == ReturnCode(16, "0x10")
    assert _conv(O.CODE, "CUDA_ERROR_OUT_OF_MEMORY") == ReturnCode(None, "CUDA_ERROR_OUT_OF_MEMORY")


@pytest.mark.parametrize(
    "argv",
    [
        ["anchors", "watch", "--duration", "1m30s"],
        ["tokenizer", "observe", "--pid", "1", "--duration", "1m30s"],
        ["tokenizer", "observe", "--pid", "1", "--seconds", "1m30s"],
        ["template", "run", "cuda-oom-sticky", "--duration", "1m30s"],
        ["hooks", "vram-pressure", "--share", "0.5", "--duration", "1m30s"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_every_duration_option_reads_1m30s(argv: list[str]) -> None:
    ctx = cli.make_context("gpufault", list(argv), resilient_parsing=True)
    cmd: click.Command = cli
    for name in argv:
        if isinstance(cmd, click.Group) and name in cmd.commands:
            cmd = cmd.commands[name]
            if not isinstance(cmd, click.Group):
                break
    rest = argv[argv.index(cmd.name) + 1 :]
    sub = cmd.make_context(cmd.name, rest, parent=ctx)
    key = "seconds" if cmd.name == "observe" else "duration"
    assert sub.params[key] == 90


def test_main_prints_a_usage_error_as_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, where in (
        (["anchors", "watch", "--duration", "soon"], "gpufault anchors watch --help"),
        (["trace", "--lib", "l", "--fn", "f", "--duration", "1m30x", "-p", "2"],
         "gpufault trace --help"),
        (["inject", "--lib", "l", "--fn", "f", "--max-db-size", "-5", "-p", "2"],
         "gpufault inject --help"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("gpufault: --") and where in err[0], err


# ---- --db: the group option, GPUFAULT_DB, a command's own -------------------


def test_db_group_option_env_and_per_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    for p in (a, b):
        store.open_db(p).conn.close()
    monkeypatch.delenv("GPUFAULT_DB", raising=False)
    r = CliRunner().invoke(cli, ["--db", str(a), "show", "nope"])
    assert r.exit_code == 2 and str(a) in r.output
    r = CliRunner().invoke(cli, ["show", "nope"], env={"GPUFAULT_DB": str(a)})
    assert str(a) in r.output
    r = CliRunner().invoke(cli, ["--db", str(a), "show", "nope", "--db", str(b)])
    assert str(b) in r.output
    assert O.db_from(None, None) == str(store.DEFAULT_DB)
    assert O.db_from(None, None, default=False) is None


# ---- completion ---------------------------------------------------------------


def test_completion_of_templates_and_experiments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = click.Context(cli)
    names = [c.value for c in completion.template_names(ctx, None, "cuda-oom")]  # type: ignore[arg-type]
    assert "cuda-oom-sticky" in names and all(n.startswith("cuda-oom") for n in names)
    monkeypatch.setattr(completion, "EXPERIMENTS_DIR", tmp_path / "none")
    assert completion.experiment_names(ctx, None, "") == []  # type: ignore[arg-type]
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "gpu-oom.toml").write_text("")
    monkeypatch.setattr(completion, "EXPERIMENTS_DIR", tmp_path / "x")
    assert [c.value for c in completion.experiment_names(ctx, None, "g")] == ["gpu-oom"]  # type: ignore[arg-type]


def test_a_registered_experiment_group_completes_experiment_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The shape of pyctl/cli/experiment.py: a group with a NAME argument that
    # says nothing about completion; registering it (one line in COMMANDS)
    # is all it takes.
    from click.shell_completion import ShellComplete

    from pyctl.cli import commands

    @click.group("experiment")
    def experiment() -> None:
        """Experiments."""

    @experiment.command()
    @click.argument("name")
    def show(name: str) -> None:
        """Show one."""

    root = click.Group("gpufault")
    commands.add(root, experiment)
    (tmp_path / "gpu-oom.toml").write_text("")
    (tmp_path / "nccl-stall.toml").write_text("")
    monkeypatch.setattr(completion, "EXPERIMENTS_DIR", tmp_path)
    got = ShellComplete(root, {}, "gpufault", "_GPUFAULT_COMPLETE").get_completions(
        ["experiment", "show"], "gpu"
    )
    assert [c.value for c in got] == ["gpu-oom"]


def test_ret_completes_the_code_names_of_the_library() -> None:
    from click.shell_completion import ShellComplete

    sc = ShellComplete(cli, {}, "gpufault", "_GPUFAULT_COMPLETE")
    nccl = [c.value for c in sc.get_completions(["inject", "--lib", "libnccl", "--ret"], "nccli")]
    assert "ncclInternalError" in nccl
    cuda = [c.value for c in sc.get_completions(["inject", "--ret"], "CUDA_ERROR_OUT")]
    assert cuda == ["CUDA_ERROR_OUT_OF_MEMORY"]


def test_fault_id_completion_reads_only_and_never_fails(tmp_path: Path) -> None:
    db = tmp_path / "gf.db"
    with sqlite3.connect(db) as c:
        c.execute("CREATE TABLE faults (fault_id TEXT, function TEXT, wall REAL)")
        c.executemany("INSERT INTO faults VALUES (?, ?, ?)",
                      [("1a2b-1", "cuMemAlloc_v2", 1.0), ("1a2b-2", "cuLaunchKernel", 2.0),
                       ("ffff-1", "x", 3.0)])  # fmt: skip
    before = sorted(p.name for p in tmp_path.iterdir()), db.stat().st_mtime_ns
    ctx = click.Context(cli)
    ctx.params["db_path"] = str(db)
    got = completion.fault_ids(ctx, None, "1a2b")  # type: ignore[arg-type]
    assert [c.value for c in got] == ["1a2b-2", "1a2b-1"]
    assert (sorted(p.name for p in tmp_path.iterdir()), db.stat().st_mtime_ns) == before
    from click.shell_completion import ShellComplete

    sc = ShellComplete(cli, {}, "gpufault", "_GPUFAULT_COMPLETE")
    for line in (["--db", str(db), "show"], ["show", "--db", str(db)]):
        assert [c.value for c in sc.get_completions(line, "ff")] == ["ffff-1"], line
    for bad in (tmp_path / "missing.db", tmp_path):
        ctx.params["db_path"] = str(bad)
        assert completion.fault_ids(ctx, None, "") == []  # type: ignore[arg-type]
    (tmp_path / "junk.db").write_bytes(b"not sqlite")
    ctx.params["db_path"] = str(tmp_path / "junk.db")
    assert completion.fault_ids(ctx, None, "") == []  # type: ignore[arg-type]


def test_shell_completion_through_click() -> None:
    env = {**os.environ, "_GPUFAULT_COMPLETE": "bash_complete",
           "COMP_WORDS": "gpufault template show cuda-oom", "COMP_CWORD": "3",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "pyctl"], env=env, capture_output=True,
                       text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "plain,cuda-oom-sticky" in r.stdout.split()
    env["_GPUFAULT_COMPLETE"] = "bash_source"
    r = subprocess.run([sys.executable, "-m", "pyctl"], env=env, capture_output=True,
                       text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert "complete " in r.stdout and "_GPUFAULT_COMPLETE" in r.stdout


# ---- the man page -------------------------------------------------------------


def test_man_page_has_every_command_and_renders(tmp_path: Path) -> None:
    text = render(cli)
    assert text.startswith(".TH GPUFAULT 1")
    for path, _ in ALL:
        assert f'.SS "{roff_escape(" ".join(["gpufault", *path]))} ' in text, path
    # Every line is a known macro or text that cannot be read as one.
    for line in text.splitlines():
        if line.startswith((".", "'")):
            assert re.match(r"\.(TH|SH|SS|TP|PP|nf|fi|B)\b", line), line
    page = tmp_path / "gpufault.1"
    page.write_text(text)
    if shutil.which("man") is None:
        pytest.skip("no man here: roff checked above only")
    r = subprocess.run(
        ["man", "--warnings", "-l", str(page)],
        capture_output=True,
        text=True,
        env={**os.environ, "MANWIDTH": "80", "MANPAGER": "cat"},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "gpufault trace" in r.stdout and "--duration" in r.stdout.replace("\u2010", "-")


# ---- doctor, template show -------------------------------------------------------


def test_doctor_marks_are_highlighted_only_on_a_terminal() -> None:
    assert mark(False, True, tty=False) == "FAIL" and mark(False, False, tty=False) == "WARN"
    assert "\x1b[" in mark(False, True, tty=True) and mark(True, True, tty=True) == "ok  "
    r = CliRunner().invoke(cli, ["doctor"])
    assert "\x1b[" not in r.output


def test_template_show_set_shows_the_value_it_will_use() -> None:
    r = CliRunner().invoke(cli, ["template", "show", "cuda-oom-sticky", "--set", "after=7"])
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.output.splitlines() if ln.strip().startswith("after "))
    assert "7 (--set; default" in line
    assert "after=7" in r.output


# ---- one spec builder, RunOptions ------------------------------------------------


def test_from_fields_reads_cli_text_and_toml_values_alike() -> None:
    text = FaultSpec.from_fields({"lib": "libcuda", "fn": ("cuMemAlloc_v2",), "action": "fail",
                                  "ret": "CUDA_ERROR_OUT_OF_MEMORY", "prob": "5%",
                                  "stall": None, "window": "1m30s", "max": "3"})  # fmt: skip
    typed = FaultSpec.from_fields({"lib": "libcuda", "fn": "cuMemAlloc_v2", "action": "fail",
                                   "ret": ReturnCode(None, "CUDA_ERROR_OUT_OF_MEMORY"),
                                   "prob": 0.05, "window": 90, "max": 3})  # fmt: skip
    assert text == typed and text.ret == 2 and text.window_start_s == 90
    assert text.prob_ppm == 50_000 and text.max_fires == 3
    own = FaultSpec.from_fields({"lib": "libfoo", "fn": "f", "action": "fail", "ret": "E_X"},
                                catalog=lambda lib, name: 77)  # fmt: skip
    assert own.ret == 77 and own.ret_text == "E_X"
    with pytest.raises(SpecError, match="unknown field"):
        FaultSpec.from_fields({"lib": "l", "fn": "f", "bogus": 1})
    with pytest.raises(SpecError, match="--ret"):
        FaultSpec.from_fields({"lib": "libcuda", "fn": "f", "action": "fail", "ret": "NOPE_X"})


def test_the_target_and_duration_reach_bpf_not_the_spec() -> None:
    s = FaultSpec(lib="l", fn="f", tgid=0).validate()
    b = s.to_bpf(start_mono_ns=1000, tgid=42, tid=43, duration_s=2.0)
    assert (b.tgid, b.tid, b.deadline_ns) == (42, 43, 1000 + 2_000_000_000)
    assert (s.tgid, s.tid, s.duration_s) == (0, 0, 0.0)
    own = FaultSpec(lib="l", fn="f", tgid=7, duration_s=1.0).validate()
    b = own.to_bpf(start_mono_ns=0, tgid=42, duration_s=9.0)
    assert (b.tgid, b.deadline_ns) == (7, 1_000_000_000)


def test_runner_takes_run_options_or_their_keywords() -> None:
    from pyctl.runner import Runner, Target

    opts = RunOptions(db_path="x.db", kind="trace", duration=3.0, quiet=True, xids=False)
    a = Runner([], Target(pid=1), opts)
    b = Runner([], Target(pid=1), db_path="x.db", kind="trace", duration=3.0, status=False,
               xids=False)  # fmt: skip
    assert a.options == b.options
    assert (a.db_path, a.kind, a.duration, a.record_xids) == ("x.db", "trace", 3.0, False)
    with pytest.raises(TypeError):
        Runner([], Target(pid=1), opts, kind="inject")


def test_a_held_command_waits_on_a_pipe_above_fd_9() -> None:
    """A run whose BPF object loaded first (pyctl/entry.py) holds its
    command on a pipe numbered above 9, which dash's `<&N` cannot take."""
    import subprocess

    from pyctl.runner import _held_command

    r, w = os.pipe()
    high = 40
    os.dup2(r, high)
    os.close(r)
    try:
        argv = _held_command(["sh", "-c", "echo ran"], high)
        p = subprocess.Popen(argv, pass_fds=(high,), stdout=subprocess.PIPE, text=True)
        os.write(w, b"go\n")
        out, _ = p.communicate(timeout=30)
    finally:
        os.close(high)
        os.close(w)
    assert (p.returncode, out) == (0, "ran\n")
