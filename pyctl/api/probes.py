"""`gpufault probes` as data: where a probe can go, the catalog's functions
or a library's, each with its probe offset and first instruction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyctl.exceptions import MissingPrerequisite


def catalog_functions() -> list[dict[str, str]]:
    """The catalogued functions (CUDA driver, NCCL, cuBLAS, cuFFT): lib,
    function and its argument list as C. MissingPrerequisite without a
    catalog."""
    try:
        # lazy: the catalog is optional: without one this raises MissingPrerequisite
        from pyctl import catalog
    except ImportError:
        raise MissingPrerequisite("no catalog installed") from None
    return [
        {"lib": f.lib, "function": f.name, "args": ", ".join(f"{a.ctype} {a.name}" for a in f.args)}
        for f in catalog.functions()
    ]


def render_catalog(rows: list[dict[str, str]]) -> str:
    """`gpufault probes`' text: one function a line."""
    return "\n".join(f"{r['lib']:7} {r['function']}({r['args']})" for r in rows)


@dataclass
class ProbeSites:
    """A library's probe sites: what `gpufault probes LIB` prints."""

    library: str  # as shown: soname and path
    mapped: bool  # found in the process's maps, not only on disk
    functions: list[dict[str, Any]]  # name, demangled, aliases, address, offset, ...

    def to_json(self) -> dict[str, Any]:
        return {"library": self.library, "mapped": self.mapped, "functions": self.functions}

    def render(self) -> str:
        # lazy: pyctl.symbols.demangle (ctypes, +5 modules) only when this runs
        from pyctl.symbols.demangle import demangle

        rows = self.functions
        names = sum(1 + len(r["aliases"]) for r in rows)
        out = [
            f"{self.library} ({'mapped' if self.mapped else 'on disk'}), {len(rows)} functions"
            + (f" ({names} names: aliases share one probe site)" if names > len(rows) else "")
        ]
        for r in rows:
            note = (
                "SLOW (single-stepped)"
                if r["slow"]
                else ("after endbr64" if r["skipped_endbr64"] else "")
            )
            # Aliases (cuMemAlloc = cuMemAlloc_v2) are one address: shown beside
            # the name, never hidden (--fn takes any of them).
            shown = " = ".join([r["demangled"], *(demangle(a) for a in r["aliases"])])
            out.append(f"  {shown:40} +{r['offset']:#x} {r['first_insn']:8} {note}")
        return "\n".join(out)


def probe_sites(lib: str, pid: int | None = None, patterns: Sequence[str] = ()) -> ProbeSites:
    """The functions of `lib` (a soname, name, path or glob; resolved in
    `pid`'s maps when given) matching the globs `patterns` (default *).
    Raises BadInput (ResolveError) for a library or pattern that matches
    nothing."""
    # lazy: keeps pyctl.symbols (resolve, demangle: ctypes, elf) off `import gpufault`
    from pyctl.symbols import resolve
    from pyctl.symbols.demangle import demangle

    L = resolve.find_library(lib, pid)
    syms = resolve.symbols(L, list(patterns) or ["*"])
    rows = [
        {
            "function": s.name,  # as in the file: what --fn takes
            "demangled": demangle(s.name),
            "aliases": s.aliases,
            "address": s.address,
            "offset": s.offset,
            "first_insn": s.first_insn,
            "skipped_endbr64": s.skipped_endbr,
            "slow": s.slow,
        }
        for s in sorted(syms, key=lambda s: s.name)
    ]
    return ProbeSites(L.display, L.mapped, rows)


__all__ = ["ProbeSites", "catalog_functions", "probe_sites", "render_catalog"]


@dataclass(frozen=True)
class SpecSites:
    """Where one spec's probes would go in a process: its library as
    resolved there, and the functions its pattern names."""

    spec: str  # the spec's one-line description
    library: str
    functions: tuple[str, ...]

    def line(self) -> str:
        fns = ", ".join(self.functions[:4]) + (
            f" and {len(self.functions) - 4} more" if len(self.functions) > 4 else ""
        )
        return f"{self.spec}: {fns} in {self.library}"


def check_specs(specs: Sequence[Any], pid: int | None = None) -> list[SpecSites]:
    """Resolve every spec's library and functions as arming would (in
    pid's maps and mount namespace when given), without arming anything:
    BadInput with arming's one line for the first that cannot be."""
    # lazy: keeps the engine's planner (pyctl.symbols, pyctl.bpf) off `import gpufault`
    from pyctl.engine.errors import EngineError
    from pyctl.engine.mechanism import plan
    from pyctl.exceptions import BadInput

    try:
        atts = plan(list(specs), pid)
    except EngineError as e:
        raise BadInput(str(e)) from None
    out = []
    for i, sp in enumerate(specs):
        mine = [a for a in atts if a.spec == i]
        lib = mine[0].lib.display if mine else str(sp.lib)
        out.append(SpecSites(sp.describe(), lib, tuple(dict.fromkeys(a.sym.name for a in mine))))
    return out
