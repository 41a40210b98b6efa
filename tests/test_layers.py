"""The layering contract (pyproject.toml [tool.importlinter], docs/layers.md):
`lint-imports` keeps every floor's imports pointing down and no package's
parts in a cycle, counting function-local imports too. The checks beside
it close what import-linter leaves open: a module of pyctl/ that no floor
names is checked by no floor, and a split package's __init__ (pyctl.service,
whose __main__ is an entry on the top floor) is named by none."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

import grimp
import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]


def _lint_imports(cwd: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    """`lint-imports` of this interpreter's import-linter (a dev dependency:
    `pip install -e '.[dev]'`, tools/setup-deps.sh), whatever PATH holds."""
    only = [a for c in contracts for a in ("--contract", c)]
    run = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    # --no-cache: a test writes nothing into the checkout
    return subprocess.run(
        [sys.executable, "-c", run, "--no-cache", *only], cwd=cwd, capture_output=True, text=True
    )


def _floors() -> list[list[str]]:
    """The layers contract's floors, top first, each a list of module names."""
    (layers,) = [c for c in CONFIG["contracts"] if c["type"] == "layers"]
    # "(name)": an optional module, one not committed yet
    return [
        [n.strip().strip("()") for n in f.replace(":", "|").split("|")] for f in layers["layers"]
    ]


def _floor_of(module: str, floors: list[list[str]]) -> int | None:
    """Index of the floor that names module or a package above it (0 = top)."""
    for i, floor in enumerate(floors):
        if any(module == n or module.startswith(n + ".") for n in floor):
            return i
    return None


def test_no_import_runs_up_the_floors() -> None:
    r = _lint_imports(REPO, "layers")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "1 kept, 0 broken" in r.stdout, r.stdout[-3000:]


def test_no_package_has_a_cycle() -> None:
    r = _lint_imports(REPO, "acyclic")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "1 kept, 0 broken" in r.stdout, r.stdout[-3000:]


def test_the_contract_lists_no_exceptions() -> None:
    """An edge that breaks a floor is fixed, not listed (issue 27)."""
    for c in CONFIG["contracts"]:
        listed = {k for k in ("ignore_imports", "exhaustive_ignores", "skip_descendants") if k in c}
        assert not listed, (c["name"], listed)
    assert {c["type"] for c in CONFIG["contracts"]} == {"layers", "acyclic_siblings"}


def test_every_module_of_pyctl_sits_on_a_floor() -> None:
    floors = _floors()
    graph = grimp.build_graph("pyctl", "gpufault", cache_dir=None)
    assert len(graph.modules) > 150
    unplaced = sorted(
        m
        for m in graph.modules
        if _floor_of(m, floors) is None and not graph.find_children(m)  # a package's
        # __init__ is split when its parts sit on different floors: below
    )
    assert unplaced == [], f"modules no floor names (add them to pyproject.toml): {unplaced}"


def test_a_split_package_init_is_imported_only_from_its_floor_or_above() -> None:
    """pyctl, pyctl.resident and pyctl.service have parts on several floors,
    so no floor names their __init__. Its floor is that of what it imports
    (pyctl.service's re-exports its config); whatever imports it must be on
    that floor or above."""
    floors = _floors()
    graph = grimp.build_graph("pyctl", "gpufault", cache_dir=None)
    split = sorted(m for m in graph.modules if _floor_of(m, floors) is None)
    assert "pyctl.service" in split and "pyctl" in split
    bad = []
    for init in split:
        under = [_floor_of(t, floors) for t in graph.find_modules_directly_imported_by(init)]
        own = min((f for f in under if f is not None), default=len(floors))
        for importer in graph.find_modules_that_directly_import(init):
            f = _floor_of(importer, floors)
            if f is not None and f > own:
                bad.append(f"{importer} -> {init} (its __init__ imports floor {own})")
    assert bad == []


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A package of two floors whose lower one imports the upper one inside a
    function, with the same kind of contract."""
    pkg = tmp_path / "planted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "high.py").write_text("from planted import low\n")
    (pkg / "low.py").write_text("def f():\n    from planted import high  # upward\n")
    (tmp_path / ".importlinter").write_text(
        textwrap.dedent("""\
            [importlinter]
            root_package = planted

            [importlinter:contract:floors]
            name = floors
            type = layers
            layers =
                planted.high
                planted.low
            """)
    )
    return tmp_path


def test_the_contract_sees_a_function_local_upward_import(planted: Path) -> None:
    r = _lint_imports(planted)
    assert r.returncode == 1, r.stdout
    assert "planted.low -> planted.high" in r.stdout, r.stdout


def test_the_floor_checks_can_fail() -> None:
    floors = [["a.top"], ["a.mid", "a.x"], ["a.low"]]
    assert _floor_of("a.mid.sub", floors) == 1
    assert _floor_of("a.midway", floors) is None
