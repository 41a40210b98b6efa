"""The experiment layer sits on the library and below the front ends: no
module of pyctl/experiment imports the command line (pyctl.cli, click) or
the reference inference service (pyctl.service, an application beside the
front ends). What an experiment needs to know about a service (its command,
device, admin token variable, tokenizer) comes from the experiment file or
from a lower layer (pyctl.tokenizer.builders.reference_bpe)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXPERIMENT = sorted((REPO / "pyctl" / "experiment").rglob("*.py"))
ABOVE = ("pyctl.service", "pyctl.cli", "pyctl.entry", "click")


def _imports(path: Path, root: Path = REPO) -> set[str]:
    """Every module an import statement names, function-local ones too;
    relative imports resolved against the module's package."""
    pkg = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(x for x in (base, node.module or "") if x)
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def _bad(paths: list[Path]) -> list[str]:
    return sorted(
        f"{p.relative_to(REPO)}: {m}"
        for p in paths
        for m in _imports(p)
        if m in ABOVE or m.startswith(tuple(f"{a}." for a in ABOVE))
    )


def test_no_experiment_module_imports_the_service_the_cli_or_click() -> None:
    assert len(EXPERIMENT) >= 10
    assert not (bad := _bad(EXPERIMENT)), bad


def test_the_check_sees_a_planted_import(tmp_path: Path) -> None:
    """The walk finds an import inside a function and a relative one."""
    pkg = tmp_path / "pyctl" / "experiment"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("def f():\n    from pyctl.service.config import DEVICES\n")
    (pkg / "b.py").write_text("from ..service import tokenizer\n")
    (pkg / "c.py").write_text("import json\nfrom . import model\n")
    got = [
        m for p in sorted(pkg.glob("*.py")) for m in _imports(p, tmp_path) if m.startswith(ABOVE)
    ]
    assert "pyctl.service.config" in got and "pyctl.service.tokenizer" in got
    assert not [m for m in _imports(pkg / "c.py", tmp_path) if m.startswith(ABOVE)]


def test_loading_and_running_an_experiment_module_loads_no_service() -> None:
    """At run time too: importing the runner and loading every shipped file
    (the service shortcut included) imports nothing of pyctl.service."""
    code = (
        "import sys\n"
        "from pyctl.experiment import load, run, corpora\n"
        "for n in load.all_names(): load.load(n)\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('pyctl.service', 'pyctl.cli')))\n"
        "print(bad)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_service_reads_the_admin_token_variable_experiments_set() -> None:
    """Not imported by the experiment layer, so checked here: the name the
    service shortcut gives the token is the one the service reads (the
    corpora's token counts: test_corpora_are_exact_where_the_class_needs_it)."""
    from pyctl.experiment import model
    from pyctl.service.perturb import TOKEN_ENV

    assert model.ADMIN_TOKEN_ENV == TOKEN_ENV


def test_every_step_kind_is_in_the_registry_and_the_runner_names_none() -> None:
    from pyctl.experiment.steps import KINDS, WORDS

    assert set(KINDS) == {"fault", "traffic", "perturb", "pressure"}
    assert set(WORDS) == {"template", "fault", "traffic", "perturb", "pressure"}
    for path in ("run.py", "evaluate.py", "method.py"):
        text = (REPO / "pyctl" / "experiment" / path).read_text()
        named = [w for w in ("TrafficRun", "PerturbRun", "PressureRun", "StepRequest") if w in text]
        assert not named, (path, named)


def test_a_kind_registered_is_found_by_the_method(tmp_path: Path) -> None:
    """The method reads its steps through the registry: a kind added there
    (as a plugin would) is parsed with no change to method.py."""
    from pyctl.experiment import load
    from pyctl.experiment.steps import KINDS, WORDS, StepKind, register

    class Noop(StepKind):
        name = "noop"
        words = ("noop",)
        refused = ("thread",)
        why = "a noop step aims at nothing: remove it"

        def parse(self, r, key, m, step):  # type: ignore[no-untyped-def]
            step.name = r.str_(m, key, "name", "noop")
            return step

    f = tmp_path / "n.toml"
    f.write_text(
        'name = "n"\nversion = 1\ntitle = "t"\n[target]\nurl = "http://127.0.0.1:1"\npid = 1\n'
        '[[method]]\nnoop = {}\nduration = "2s"\n'
    )
    register(Noop())
    try:
        (step,) = load.load(str(f)).steps
        assert (step.kind, step.label, step.name, step.duration) == ("noop", "noop", "noop", 2.0)
        f.write_text(f.read_text() + 'thread = "gf-worker"\n')
        with pytest.raises(load.ExperimentError, match=r"method\[1\]\.thread: a noop"):
            load.load(str(f))
    finally:
        del KINDS["noop"], WORDS["noop"]
