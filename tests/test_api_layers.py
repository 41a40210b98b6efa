"""The library sits below its front ends: no library module imports the
command line (pyctl/cli, click), nor does anything built on the library
beside the CLI (the pytest plugin, the Chaos Toolkit extension); `import
gpufault` loads no CLI module. The front ends themselves: pyctl/cli/,
the entry points (__main__, entry.py) and `gpufault serve`'s server,
which runs the CLI in its forked controllers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIBRARY = [*sorted((REPO / "pyctl" / "api").glob("*.py"))]
FRONTS = [
    REPO / "pyctl" / "pytest_plugin.py",
    *sorted((REPO / "pyctl" / "chaostoolkit").glob("*.py")),
]


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


CLI_SIDE = ("pyctl/cli/", "pyctl/__main__.py", "pyctl/entry.py", "pyctl/service/__main__.py",
            "pyctl/resident/server.py")  # fmt: skip


def _cli_imports(paths: list[Path]) -> set[str]:
    return {
        f"{p.relative_to(REPO)}: {m}"
        for p in paths
        for m in _imports(p)
        if m == "click" or m.startswith(("pyctl.cli", "pyctl.entry"))
    }


def test_the_library_and_its_front_ends_never_import_the_cli() -> None:
    assert not (bad := _cli_imports(LIBRARY + [f for f in FRONTS if f.exists()])), sorted(bad)


def test_no_library_module_imports_the_cli() -> None:
    """The command modules of experiment, service, tokenizer, report and
    calls live in pyctl/cli/ (they sat in the packages below and imported
    pyctl.cli.options upward)."""
    lib = [
        p
        for p in sorted((REPO / "pyctl").rglob("*.py"))
        if not str(p.relative_to(REPO)).startswith(CLI_SIDE)
    ]
    assert len(lib) > 100
    assert not (bad := _cli_imports(lib)), sorted(bad)


def test_importing_gpufault_loads_no_cli_module() -> None:
    code = (
        "import sys, gpufault; "
        "print(sorted(m for m in sys.modules if m == 'click' or m.startswith('pyctl.cli')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=REPO, check=True)  # fmt: skip
    assert r.stdout.strip() == "[]", r.stdout


# What a command module may import of pyctl besides the API (pyctl.api*),
# its own package (pyctl.cli*) and the error hierarchy (pyctl.exceptions),
# and why (issue 27: no command reaches around the API).
CLI_MAY_IMPORT = {
    # Presentation only, kept at the bottom of the house so that the entry
    # point can use them before anything else is imported:
    "pyctl.argv": "which command argv names, read before click (entry.py too)",
    "pyctl.outchan": "stderr as best effort while a run lasts (prints, never evidence)",
    # Above the API: the CLI is their front end, and the API cannot import them.
    "pyctl.experiment": "experiments, a layer above the API (run, results, corpora)",
    "pyctl.observe": "gpufault's own /metrics exporter, in the experiment layer",
    "pyctl.explore": "fault-space exploration (`gpufault explore`), a floor above the experiments",
    "pyctl.report": "experiment reports (HTML, Markdown), in the experiment layer",
    "pyctl.service": "the reference inference service, an application beside the front ends",
    "pyctl.resident.server": "`gpufault serve`'s server, a front end that runs the CLI",
    "pyctl.agent": "the node agent's server and client, a floor above the API (its client)",
}


def _pyctl_imports(path: Path) -> set[str]:
    """Every pyctl module path imports, function-local ones too; `from
    pyctl import x` names pyctl.x."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("pyctl")}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "pyctl":
                out |= {f"pyctl.{a.name}" for a in node.names}
            elif node.module.startswith("pyctl."):
                out.add(node.module)
    return out


def _allowed(module: str) -> bool:
    own = ("pyctl.api", "pyctl.cli", "pyctl.exceptions", *CLI_MAY_IMPORT)
    return any(module == m or module.startswith(m + ".") for m in own)


def test_every_command_goes_through_the_api() -> None:
    """pyctl/cli/*.py import nothing of pyctl below the API: no command
    reaches around it (the engine, the store, the symbols, the kernel
    access are the API's to call)."""
    cli = sorted((REPO / "pyctl" / "cli").glob("*.py"))
    assert len(cli) > 20
    bad = sorted(
        f"{p.relative_to(REPO)}: {m}" for p in cli for m in _pyctl_imports(p) if not _allowed(m)
    )
    assert not bad, "commands reaching around pyctl.api:\n" + "\n".join(bad)


def test_the_scan_sees_a_command_that_reaches_around(tmp_path: Path) -> None:
    """The check above can fail: a function-local import of the store and a
    `from pyctl import netchaos` are both seen; the API's are not."""
    f = tmp_path / "cmd.py"
    f.write_text(
        "from pyctl import api, netchaos\n"
        "from pyctl.api import reading\n"
        "def show():\n    from pyctl.evidence import store\n"
    )
    seen = _pyctl_imports(f)
    assert seen == {"pyctl.api", "pyctl.netchaos", "pyctl.evidence"}
    assert [m for m in sorted(seen) if not _allowed(m)] == ["pyctl.evidence", "pyctl.netchaos"]


def test_the_api_modules_the_cli_uses_import_no_front_end() -> None:
    """The API's modules never import the experiment layer, the service or
    the server above them (the CLI may; they may not)."""
    above = (
        *("pyctl.experiment", "pyctl.observe", "pyctl.report", "pyctl.service"),
        *("pyctl.resident.server", "pyctl.chaostoolkit", "pyctl.pytest_plugin"),
    )
    bad = sorted(
        f"{p.relative_to(REPO)}: {m}"
        for p in LIBRARY
        for m in _pyctl_imports(p)
        if any(m == a or m.startswith(a + ".") for a in above)
    )
    assert not bad, bad
