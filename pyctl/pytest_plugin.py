"""gpufault's pytest plugin (a pytest11 entry point: on wherever gpufault is
installed; docs/api.md, "pytest plugin").

- the `gpufault` fixture: arm() faults into a process under test; the
  test's teardown disarms every session it armed, whether the test passed,
  failed, or was interrupted (Ctrl-C: pytest tears fixtures down at the end
  of the session, and the plugin disarms anything still armed then and at
  interpreter exit);
- the `gpufault` marker: skip, with the reason, where this host cannot arm
  faults ("requires root (BPF, ptrace)", "kernel lacks uprobes/BPF: ...");
  `--gpufault-no-skip` makes that a failure (a CI host that must run them);
  `@pytest.mark.gpufault(isolate=True, duration=30)` sets the fixture's
  defaults for that test;
- assertion helpers: gpufault.assert_fired / assert_followed (also on the
  fixture: a test that takes the fixture shadows `import gpufault`).

Every pytest in an environment with gpufault installed loads this module,
so it imports nothing of the engine until a test asks for it.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

MARKER = "gpufault"
ROOT_REASON = "requires root (BPF, ptrace)"
KERNEL_REASON = "kernel lacks uprobes/BPF"
BUILD_REASON = "gpufault's BPF objects are not built"

# Every session any fixture armed and has not disarmed yet: the backstop
# for a teardown that never ran (a KeyboardInterrupt between setup and
# teardown, an internal error), drained at session end and at exit.
_LIVE: list[Any] = []
_LIVE_LOCK = threading.Lock()


# ---- can this host arm faults? ---------------------------------------------
def reason(euid: int, kernel_problem: str | None, built_problem: str | None = None) -> str | None:
    """The skip reason for a host: root first (without it nothing else can
    be probed), then the kernel, then the build. None: it can."""
    if euid != 0:
        return f"{ROOT_REASON}: running as uid {euid}"
    if kernel_problem:
        return f"{KERNEL_REASON}: {kernel_problem}"
    if built_problem:
        return f"{BUILD_REASON}: {built_problem}"
    return None


def _kernel_problem() -> str | None:
    """What `gpufault doctor` checks for trace and inject, probed for real
    (a load of the engine's programs), never read from the version."""
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        return "no /sys/kernel/btf/vmlinux (CONFIG_DEBUG_INFO_BTF): CO-RE relocations fail"
    # libbpf attaches uprobes through this PMU (and uprobe_multi needs CONFIG_UPROBES too).
    if not os.path.exists("/sys/bus/event_source/devices/uprobe/type"):
        return "no uprobe PMU in /sys/bus/event_source/devices (CONFIG_UPROBE_EVENTS)"
    return None


def _load_problem() -> tuple[str | None, str | None]:
    """(kernel problem, build problem) from loading the engine's programs."""
    # lazy: keeps pyctl.capabilities (+5 modules) off pytest's plugin load
    from pyctl import capabilities as caps

    if not caps.MAIN_OBJ.exists():
        return None, f"{caps.MAIN_OBJ} is missing: run make build (or install the wheel)"
    try:
        # lazy: the plugin loads in every pytest run: libbpf only when a marker asks
        from pyctl.bpf.libbpf import BpfError, Object
    except Exception as e:  # noqa: BLE001 - no libbpf: say so, never crash collection
        return f"libbpf does not load: {e}", None
    obj = None
    try:
        obj = Object(caps.MAIN_OBJ)
        caps.select_programs(obj, regs=False, user_writes=False)
        obj.load()
        return None, None
    except BpfError as e:
        return f"the engine's programs do not load: {e}", None
    finally:
        if obj is not None:
            obj.close()


@lru_cache(maxsize=1)
def skip_reason() -> str | None:
    """Why this host cannot arm faults, or None (probed once a process)."""
    euid = os.geteuid()
    if euid != 0:
        return reason(euid, None)
    kernel = _kernel_problem()
    built = None
    if kernel is None:
        kernel, built = _load_problem()
    return reason(euid, kernel, built)


# ---- hooks -----------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpufault")
    group.addoption(
        "--gpufault-no-skip",
        action="store_true",
        default=False,
        help="fail tests marked gpufault where this host cannot arm faults, instead of "
        "skipping them (for a CI host that must run them)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(isolate=False, duration=0): arms real faults (BPF uprobes, ptrace); "
        "skipped with the reason where this host cannot (not root, no uprobes/BPF); "
        "isolate/duration: the gpufault fixture's defaults for the test",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A skip marker, not pytest.skip() at setup: the report names the test's
    # line (-rs), and no fixture of a skipped test is set up (tmp_path).
    marked = [it for it in items if it.get_closest_marker(MARKER) is not None]
    if not marked or config.getoption("gpufault_no_skip"):
        return
    why = skip_reason()
    if why is not None:
        for it in marked:
            it.add_marker(pytest.mark.skip(reason=why))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # --gpufault-no-skip: the same reason, as the test's error.
    if item.get_closest_marker(MARKER) is None or not item.config.getoption("gpufault_no_skip"):
        return
    why = skip_reason()
    if why is not None:
        pytest.fail(f"gpufault: {why} (--gpufault-no-skip)", pytrace=False)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    # After pytest's own teardown of every fixture (runner's sessionfinish):
    # what is still armed here lost its teardown.
    disarm_all()


def disarm_all() -> list[str]:
    """Disarm every session a fixture armed and that is still live; the
    run IDs disarmed."""
    with _LIVE_LOCK:
        live = list(reversed(_LIVE))
        _LIVE.clear()
    done = []
    for s in live:
        try:
            s.disarm()
        except BaseException:  # noqa: BLE001 - disarm the rest before anything else
            pass
        done.append(s.run_id)
    return done


atexit.register(disarm_all)


# ---- the fixture -----------------------------------------------------------
class GpufaultFixture:
    """What the `gpufault` fixture gives a test: arm() whose sessions the
    test's teardown disarms, the test's evidence database, and the
    library's names (gpufault.Fault, gpufault.Target, gpufault.assert_fired
    ...), since the fixture's name shadows `import gpufault` in the test."""

    def __init__(self, db: Path, *, isolate: bool = False, duration: float = 0.0) -> None:
        self.db = db
        self.isolate = isolate
        self.duration = duration
        self.sessions: list[Any] = []

    def arm(
        self,
        spec: Any,
        target: Any,
        *,
        duration: float | None = None,
        isolate: bool | None = None,
        db: str | os.PathLike[str] | None = None,
        **kw: Any,
    ) -> Any:
        """gpufault.arm() with the fixture's defaults (db: the test's file
        under tmp_path; isolate, duration: the marker's, else in-process and
        until teardown); the session is disarmed at teardown."""
        # lazy: keeps pyctl.api (+1 module) off pytest's plugin load
        from pyctl import api

        s = api.arm(
            spec,
            target,
            db=self.db if db is None else db,
            duration=self.duration if duration is None else duration,
            isolate=self.isolate if isolate is None else isolate,
            **kw,
        )
        with _LIVE_LOCK:
            _LIVE.append(s)
        self.sessions.append(s)
        return s

    def disarm(self) -> None:
        """Disarm every session this test armed (teardown does it too)."""
        errors = []
        for s in reversed(self.sessions):
            try:
                s.disarm()
            finally:
                with _LIVE_LOCK:
                    if s in _LIVE:
                        _LIVE.remove(s)
            if s.error is not None and s.run_id:
                errors.append(f"run {s.run_id}: {s.error}")
        if errors:
            # A run that failed after arming (its evidence could not be
            # written, say) is the test's failure too: its evidence is short.
            raise AssertionError("gpufault: " + "; ".join(errors))

    def evidence(self) -> Any:
        """The test's database, read-only (gpufault.Evidence)."""
        # lazy: keeps pyctl.api (+1 module) off pytest's plugin load
        from pyctl import api

        return api.Evidence(self.db)

    def faults(self) -> list[Any]:
        """Every fault this test's sessions fired, in fire order."""
        return [f for s in self.sessions for f in s.faults()]

    def assert_fired(self, session: Any = None, n: int | None = None, **kw: Any) -> list[Any]:
        """gpufault.assert_fired; with no session, the only one armed."""
        # lazy: keeps pyctl.api.asserts (+6 modules) off pytest's plugin load
        from pyctl.api.asserts import assert_fired

        return assert_fired(self._one(session), n, **kw)

    def assert_followed(self, fault: Any, kind: str, **kw: Any) -> list[dict[str, Any]]:
        # lazy: keeps pyctl.api.asserts (+6 modules) off pytest's plugin load
        from pyctl.api.asserts import assert_followed

        return assert_followed(fault, kind, **kw)

    def _one(self, session: Any) -> Any:
        if session is not None:
            return session
        if len(self.sessions) != 1:
            raise ValueError(
                f"gpufault.assert_fired: {len(self.sessions)} sessions armed: pass the one to check"
            )
        return self.sessions[0]

    def __getattr__(self, name: str) -> Any:
        # lazy: keeps pyctl.api (+1 module) off pytest's plugin load
        from pyctl import api

        if name in api.__all__:
            return getattr(api, name)
        raise AttributeError(f"the gpufault fixture has no {name!r}")

    def __repr__(self) -> str:
        return f"<gpufault fixture: {len(self.sessions)} session(s), db {self.db}>"


def _marker_defaults(node: pytest.Item) -> dict[str, Any]:
    m = node.get_closest_marker(MARKER)
    if m is None:
        return {}
    if m.args:
        raise pytest.UsageError(f"{node.nodeid}: @pytest.mark.gpufault takes keywords only")
    bad = set(m.kwargs) - {"isolate", "duration"}
    if bad:
        raise pytest.UsageError(
            f"{node.nodeid}: @pytest.mark.gpufault: unknown {', '.join(sorted(bad))} "
            "(isolate=, duration=)"
        )
    return dict(m.kwargs)


@pytest.fixture
def gpufault(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[GpufaultFixture]:
    """Arm faults into a process under test; teardown disarms them all."""
    d = _marker_defaults(request.node)  # type: ignore[arg-type]
    fx = GpufaultFixture(
        tmp_path / "gpufault.db",
        isolate=bool(d.get("isolate", False)),
        duration=float(d.get("duration", 0.0)),
    )
    try:
        yield fx
    finally:
        fx.disarm()


__all__: Sequence[str] = [
    "GpufaultFixture",
    "skip_reason",
    "reason",
    "disarm_all",
    "ROOT_REASON",
    "KERNEL_REASON",
]
