"""One error contract for every command group (pyctl/errors.py): a user or
environment error is one `gpufault: ...` line on stderr and exit 2; a bug is
one line with the --debug hint and exit 70; --debug shows the traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest

from pyctl import cli as cli_mod

REPO = Path(__file__).resolve().parent.parent


def _gpufault(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pyctl", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd or REPO,
    )


# One bad input per command group; each must be refused the same way.
BAD = [
    ("--no-such-option",),
    (
        "inject",
        "--lib",
        "no-such-lib-xyz",
        "--fn",
        "f",
        "--action",
        "fail",
        "--ret",
        "1",
        "--pid",
        "1",
    ),
    ("trace", "--lib", "libc", "--fn", "getpid", "--duration", "banana", "--", "true"),
    ("show", "no-such-fault", "--db", "/nonexistent-dir/x.db"),
    ("template", "show", "no-such-template"),
    ("tokenizer", "fuzz", "--target", "no_such_module_xyz:1"),
    ("hooks", "vram-pressure", "--share", "2.5"),
    ("anchors", "fire", "--code", "not-a-number"),
    ("netchaos", "no-such-subcommand"),
]


@pytest.mark.parametrize("args", BAD, ids=lambda a: " ".join(a[:2]))
def test_every_group_refuses_bad_input_in_one_line_with_exit_2(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    r = _gpufault(*args, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("gpufault: "), r.stderr
    assert "Traceback" not in r.stderr and "Error:" not in r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written where it ran


@pytest.fixture
def boom() -> object:
    @click.command("boom-test")
    def boom_cmd() -> None:
        raise RuntimeError("a bug")

    cli_mod.cli.add_command(boom_cmd)
    yield
    cli_mod.cli.commands.pop("boom-test")
    cli_mod._DEBUG = False


def test_internal_error_is_one_line_with_the_debug_hint(
    boom: object, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli_mod.main(["boom-test"])
    assert e.value.code == 70
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "gpufault: internal error: RuntimeError: a bug: run with --debug for the traceback"
    ]


def test_debug_lets_the_traceback_through(boom: object) -> None:
    with pytest.raises(RuntimeError, match="a bug"):
        cli_mod.main(["--debug", "boom-test"])


def test_exit_status_of_a_command_passes_through() -> None:
    r = _gpufault("--version")
    assert r.returncode == 0 and "gpufault" in r.stdout
