"""One error contract for every command (`gpufault.cli.main`).

- A user or environment error (bad input, missing privilege, a kernel that
  lacks something) prints `gpufault: <what went wrong>: <what to do>` on
  stderr and exits 2. The command has left nothing behind by then: each
  one checks its input before it loads, attaches or writes anything, and
  undoes what it started when a later step fails.
- An unexpected internal error prints one line and "run with --debug for
  the traceback", and exits 70 (EX_SOFTWARE); `gpufault --debug ...` (or
  GPUFAULT_DEBUG=1) lets the traceback through.
- A run that started but could not write its evidence (disk full): every
  fault stopped and detached, the run marked failed, exit 3, one line.
- Ctrl-C before a command has its own handler: exit 130, one line.

The library's modules raise their own exception classes (SpecError,
ResolveError, ...); `user_error_types()` lists which of them are the
user's or the environment's to fix, so the library needs no CLI import.
"""

from __future__ import annotations

import importlib

EXIT_USER = 2
EXIT_RUN_FAILED = 3
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130

# module, class: raised for what the user or the machine must change.
_USER_ERRORS = (
    ("pyctl.spec", "SpecError"),
    ("pyctl.engine", "EngineError"),
    ("pyctl.symbols.resolve", "ResolveError"),
    ("pyctl.xid", "XidError"),
    ("pyctl.tracefs", "TracefsError"),
    ("pyctl.templates", "TemplateError"),
    ("pyctl.experiment.model", "ExperimentError"),
    ("pyctl.experiment.probes", "ProbeError"),
    ("pyctl.experiment.loadgen", "LoadError"),
    ("pyctl.evidence.store", "StoreError"),
    ("pyctl.netchaos", "NetChaosError"),
    ("pyctl.copilot.model", "CopilotError"),
    ("pyctl.tokenizer.targets", "TargetError"),
    ("pyctl.tokenizer.targets", "TargetRejected"),
    ("pyctl.hooks.vram_pressure", "PressureError"),
    ("pyctl.hooks.bitflip", "BitSpecError"),
    ("pyctl.hooks.wmma_flip", "WmmaError"),
    ("pyctl.bpf.libbpf", "BpfError"),
    ("pyctl.observe", "ObserveError"),
    ("pyctl.report.data", "ReportError"),
    ("pyctl.calls.summary", "SummaryError"),
    ("pyctl.calls.aggregate", "AggregateError"),
)


def user_error_types() -> tuple[type[BaseException], ...]:
    """The classes above that import here (an optional group's module may
    need a package this host lacks; its errors cannot occur then)."""
    out: list[type[BaseException]] = [PermissionError]
    for mod, name in _USER_ERRORS:
        try:
            cls = getattr(importlib.import_module(mod), name)
        except Exception:  # noqa: BLE001 - absent optional module: nothing to catch
            continue
        out.append(cls)
    return tuple(out)


def hint_for(exc: BaseException) -> str:
    """What to do, for errors whose text does not say it already."""
    # lazy: keeps pyctl.bpf.libbpf (+9 modules) off `trace --help` and `import gpufault`
    from pyctl.bpf.libbpf import BpfError

    if isinstance(exc, BpfError):
        return "see `gpufault doctor`"
    if isinstance(exc, PermissionError):
        return "run as root"
    return ""


def one_line(exc: BaseException) -> str:
    """The message of exc on one line, with a hint when it has no ': '."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    hint = hint_for(exc)
    return f"{text}: {hint}" if hint and hint not in text else text
