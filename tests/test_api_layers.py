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
