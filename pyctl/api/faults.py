"""Fault specs from Python: keyword constructors over the one spec builder.

`Fault.fail("libcuda", "cuMemAlloc_v2", ret="CUDA_ERROR_OUT_OF_MEMORY",
nth=3)` is `gpufault inject --lib libcuda --fn cuMemAlloc_v2 --action fail
--ret CUDA_ERROR_OUT_OF_MEMORY --nth 3`: every constructor goes through
FaultSpec.from_fields, so a value means the same in Python, on the command
line, in a template and in an experiment file ("5%", "20ms", "SIGSEGV",
"arg2>=200M" are read by the same parsers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pyctl.api.errors import BadInput
from pyctl.spec import FaultSpec, SpecError

Fn = str | Sequence[str]


def _build(fields: Mapping[str, Any]) -> FaultSpec:
    try:
        return FaultSpec.from_fields(fields)
    except SpecError as e:
        raise BadInput(str(e)) from e


def _fields(lib: str, fn: Fn, action: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"lib": lib, "fn": fn if isinstance(fn, str) else list(fn)}
    out["action"] = action
    for k, v in extra.items():
        # Python spellings of the two option names that are not identifiers
        # or shadow builtins.
        k = {"max_fires": "max", "stack": "no_stack"}.get(k, k)
        if k == "no_stack" and "stack" in extra:
            v = not v
        out[k] = v
    return out


class Fault:
    """Namespace of constructors; each returns a validated FaultSpec.

    Trigger keywords shared by all: nth, every, after, max (or max_fires),
    prob ("5%" or 0.05), window ("10s": start firing after), when
    ("arg2>=200M"), caller ("libtorch_cpu"), sticky, stack (False: no
    stack capture), trace (record every call too)."""

    @staticmethod
    def fail(
        lib: str,
        fn: Fn,
        *,
        ret: int | str,
        mode: str = "skip",
        errno: int | str | None = None,
        **trigger: Any,
    ) -> FaultSpec:
        """Return `ret` (a number or the catalog's code name) instead of the
        call's own result: mode "skip" skips the body, "after" runs it first.
        errno ("EIO" or 5): also set the thread's errno (`--errno`)."""
        extra = {"ret": ret, "mode": mode, "errno": errno, **trigger}
        return _build(_fields(lib, fn, "fail", extra))

    @staticmethod
    def stall(lib: str, fn: Fn, *, stall: str | float, **trigger: Any) -> FaultSpec:
        """Hold the calling thread for `stall` ("5ms", or seconds as a
        number) at the call's entry, then let it go on."""
        if isinstance(stall, (int, float)) and not isinstance(stall, bool):
            stall = f"{float(stall) * 1000:g}ms"
        return _build(_fields(lib, fn, "stall", {"stall": stall, **trigger}))

    @staticmethod
    def hang(lib: str, fn: Fn, **trigger: Any) -> FaultSpec:
        """Hold the calling thread until the session ends (its deadline)."""
        return _build(_fields(lib, fn, "stall", trigger))

    @staticmethod
    def signal(lib: str, fn: Fn, *, signal: str | int, **trigger: Any) -> FaultSpec:
        """Send `signal` ("SIGSEGV", "SIGABRT", 11) to the calling thread."""
        return _build(_fields(lib, fn, "signal", {"signal": signal, **trigger}))

    @staticmethod
    def corrupt(lib: str, fn: Fn, *, corrupt: str, **trigger: Any) -> FaultSpec:
        """Corrupt an argument or what the call wrote ("arg1:zero",
        "arg1+8:flip:0x1", see docs/cli.md --corrupt)."""
        return _build(_fields(lib, fn, "corrupt", {"corrupt": corrupt, **trigger}))

    @staticmethod
    def observe(lib: str, fn: Fn, **trigger: Any) -> FaultSpec:
        """Record each matching call as a fault, changing nothing."""
        return _build(_fields(lib, fn, "observe", trigger))

    @staticmethod
    def trace(lib: str, fn: Fn, *, entry_only: bool = False) -> FaultSpec:
        """Record every call (args, return code, latency), inject nothing:
        what `gpufault trace` arms."""
        return _build(
            {"lib": lib, "fn": fn if isinstance(fn, str) else list(fn), "action": "observe",
             "trace": True, "entry_only": entry_only}
        )  # fmt: skip

    @staticmethod
    def from_fields(fields: Mapping[str, Any]) -> FaultSpec:
        """A spec from option-named fields, as a TOML [[fault]] table has them."""
        return _build(fields)

    @staticmethod
    def from_template(name: str, **sets: Any) -> list[FaultSpec]:
        """A shipped template's faults (`gpufault template list`), knobs set
        by keyword: Fault.from_template("cuda-oom-sticky", nth=3)."""
        return template(name, **sets)[1]


def template(name: str, **sets: Any) -> tuple[str, list[FaultSpec]]:
    """(its identity "name@vN", its specs)."""
    # lazy: keeps pyctl.templates (datetime, tomllib, +9 modules) off `import gpufault`
    from pyctl import templates as T

    try:
        t = T.get(name)
        return t.ident, t.specs({k: str(v) for k, v in sets.items()})
    except T.TemplateError as e:
        raise BadInput(str(e)) from e


def spec_from_json(d: Mapping[str, Any]) -> FaultSpec:
    """FaultSpec.to_json()'s inverse (a spec sent to a child on a pipe)."""
    names = {f.name for f in dataclasses.fields(FaultSpec)}
    unknown = set(d) - names
    if unknown:
        raise BadInput(f"spec: unknown field(s) {', '.join(sorted(unknown))}")
    kw = dict(d)
    for k in ("pred", "corrupt"):
        if kw.get(k) is not None:
            kw[k] = tuple(kw[k])
    try:
        return FaultSpec(**kw).validate()
    except (SpecError, TypeError) as e:
        raise BadInput(f"spec: {e}") from e


__all__ = ["Fault", "template", "spec_from_json"]
