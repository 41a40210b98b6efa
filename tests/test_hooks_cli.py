"""The click commands of pyctl/cli/hooks.py and pyctl/cli/netchaos.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pyctl.cli.hooks import hooks_group
from pyctl.cli.netchaos import netchaos_group

REPO = Path(__file__).resolve().parent.parent


def _all_commands() -> list[tuple[str, click.Command]]:
    return [
        (f"{g.name} {n}", c) for g in (hooks_group, netchaos_group) for n, c in g.commands.items()
    ]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name, cmd", _all_commands())
def test_every_command_has_help_with_example(name: str, cmd: click.Command) -> None:
    assert cmd.help and "Example:" in cmd.help, name


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler (apt-get install gcc)")
    d = tmp_path_factory.mktemp("shim")
    subprocess.run(["make", "-s", "-C", str(REPO / "pyctl/hooks/preload"), f"OUT={d}"], check=True)
    return d / "gfpreload.so"


def test_preload_env_prints_exports(shim: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(
        hooks_group,
        [
            "preload-env",
            "cuLaunchKernel:every=7:ret=719",
            "--so",
            str(shim),
            "--log",
            str(tmp_path / "x"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert f"export LD_PRELOAD='{shim}'" in r.output
    assert "export GPUFAULT_PRELOAD='cuLaunchKernel:every=7:ret=719'" in r.output


def test_preload_env_rejects_bad_rules_in_one_line(shim: Path) -> None:
    r = CliRunner().invoke(hooks_group, ["preload-env", "cuFoo:nth=1", "--so", str(shim)])
    assert r.exit_code == 1
    assert "unknown function" in r.output and r.output.count("\n") == 1


def test_preload_env_missing_shim(tmp_path: Path) -> None:
    r = CliRunner().invoke(
        hooks_group, ["preload-env", "cuCtxSynchronize:nth=1", "--so", str(tmp_path / "none.so")]
    )
    assert r.exit_code == 1 and "make build" in r.output


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="requires root (netns)")
def test_netchaos_cleanup_command_runs() -> None:
    r = CliRunner().invoke(netchaos_group, ["cleanup"])
    assert r.exit_code == 0, r.output


PLANTED = "import pathlib; pathlib.Path({marker!r}).write_text(__name__)\n"


@pytest.mark.parametrize(
    "command, real",
    [
        (["vram-pressure", "--share", "2", "--duration", "1"], "vram_pressure"),
        (["tc-measure", "--no-such-option"], "tc_measure"),
    ],
)
def test_hooks_never_import_from_the_working_directory(
    command: list[str],
    real: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # A planted ./hooks/vram_pressure.py once ran as root. Plant both the old
    # and the new module path (and a ./pyctl package) in the cwd, point
    # PYTHONPATH at it too: the child runs in isolated mode and imports none.
    markers = []
    for rel in (
        "hooks/__init__.py",
        "hooks/vram_pressure.py",
        "hooks/tc_measure.py",
        "pyctl/__init__.py",
        "pyctl/hooks/__init__.py",
        "pyctl/hooks/vram_pressure.py",
        "pyctl/hooks/tc_measure.py",
    ):
        marker = tmp_path / ("ran-" + rel.replace("/", "_"))
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(PLANTED.format(marker=str(marker)))
        markers.append(marker)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    r = CliRunner().invoke(hooks_group, command)
    assert [m.name for m in markers if m.exists()] == []
    # The real module ran and said so (no GPU, a bad option; or no torch).
    assert r.exit_code in (1, 2), r.output
    assert real in capfd.readouterr().err
