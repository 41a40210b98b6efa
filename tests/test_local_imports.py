"""Every function-local import in pyctl/ says why it is not at the top of
its module (docs/layers.md, "Function-local imports"): a `# lazy: <reason>`
comment at the end of the import or in the comment block right above it.
Imports on consecutive lines share the first one's reason. The layering
contract (tests/test_layers.py) already counts these imports, so a reason
is about time or optional packages, never about hiding an upward edge."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pyctl"
TAG = "# lazy:"


def _own_reason(lines: list[str], node: ast.stmt) -> bool:
    end = node.end_lineno or node.lineno
    if any(TAG in lines[k] for k in range(node.lineno - 1, end)):
        return True
    k = node.lineno - 2
    while k >= 0 and lines[k].lstrip().startswith("#"):
        if TAG in lines[k].strip() or lines[k].strip().startswith("# lazy:"):
            return True
        k -= 1
    return False


def unexplained(source: str) -> list[int]:
    """Line numbers of the function-local imports in source without a reason."""
    lines = source.splitlines()
    bad: list[int] = []

    def body_lists(node: ast.AST) -> list[list[ast.stmt]]:
        out = []
        for field in ("body", "orelse", "finalbody"):
            b = getattr(node, field, None)
            if isinstance(b, list):
                out.append(b)
        for h in getattr(node, "handlers", []) or []:
            out.append(h.body)
        for c in getattr(node, "cases", []) or []:
            out.append(c.body)
        return out

    def visit(node: ast.AST, in_function: bool) -> None:
        for body in body_lists(node):
            explained_prev: ast.stmt | None = None
            for st in body:
                if in_function and isinstance(st, (ast.Import, ast.ImportFrom)):
                    prev = explained_prev
                    shared = prev is not None and prev.end_lineno == st.lineno - 1
                    if _own_reason(lines, st) or shared:
                        explained_prev = st
                    else:
                        bad.append(st.lineno)
                        explained_prev = None
                else:
                    explained_prev = None
                visit(st, in_function or isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return bad


def test_every_function_local_import_has_a_reason() -> None:
    missing = []
    count = 0
    for p in sorted(ROOT.rglob("*.py")):
        src = p.read_text()
        missing += [f"{p.relative_to(ROOT.parent)}:{n}" for n in unexplained(src)]
        count += src.count(TAG)
    assert count > 50  # the walk found the package
    assert missing == [], f"{len(missing)} function-local imports without a `{TAG}` reason"


def test_the_reason_check_can_fail() -> None:
    src = (
        "import os\n"
        "def f():\n"
        "    import json\n"  # 3: no reason
        "    # lazy: pulls in sqlite3 only here\n"
        "    import sqlite3\n"
        "    import csv\n"  # shares the line above's reason
        "\n"
        "    import zlib  # lazy: only for compressed sections\n"
        "    if os.environ:\n"
        "        import gzip\n"  # 10: no reason
        "class C:\n"
        "    import abc\n"  # a class body at module level: not function-local
        "    def m(self):\n"
        "        # a comment that gives no reason\n"
        "        import bz2\n"  # 15
    )
    assert unexplained(src) == [3, 10, 15]
