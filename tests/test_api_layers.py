"""The library sits below its front ends: nothing in pyctl/api (nor the
pytest plugin or the Chaos Toolkit extension built on it) imports the
command line, and `import gpufault` loads no CLI module."""

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


def test_the_library_and_its_front_ends_never_import_the_cli() -> None:
    bad = {
        f"{p.relative_to(REPO)}: {m}"
        for p in LIBRARY + [f for f in FRONTS if f.exists()]
        for m in _imports(p)
        if m == "click" or m.startswith(("pyctl.cli", "pyctl.experiment.cli", "pyctl.entry"))
    }
    assert not bad, sorted(bad)


def test_importing_gpufault_loads_no_cli_module() -> None:
    code = (
        "import sys, gpufault; "
        "print(sorted(m for m in sys.modules if m == 'click' or m.startswith('pyctl.cli')))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=REPO, check=True)  # fmt: skip
    assert r.stdout.strip() == "[]", r.stdout
