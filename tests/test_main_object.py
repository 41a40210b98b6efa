"""The engine's object loaded early (pyctl/bpf/main_object.py): the run
takes it only when its settings are the ones it was loaded with; any other
is closed, never leaked; and the early load can be turned off."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest

from pyctl.bpf import main_object, warmup
from pyctl.bpf.features import MAIN_OBJ
from pyctl.bpf.names import Main

pytestmark = [pytest.mark.root]


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def no_early_left() -> Iterator[None]:
    yield
    main_object.take_early(main_object.default_settings())  # closes a leftover
    assert main_object._early is None


def test_the_run_takes_the_early_object_when_its_settings_match() -> None:
    main_object.start_early()
    obj = main_object.take_early(main_object.default_settings())
    assert obj is not None
    try:
        assert obj.map_fd(Main.EVENTS) >= 0  # loaded: its maps exist
    finally:
        obj.close()
    assert main_object.take_early(main_object.default_settings()) is None  # taken once


def test_other_settings_get_none_and_the_early_object_is_closed() -> None:
    before = _fds()
    main_object.start_early()
    other = dataclasses.replace(main_object.default_settings(), ring_bytes=16 << 20)
    assert main_object.take_early(other) is None
    assert _fds() == before  # its maps, programs and BTF: all closed


def test_the_warmup_closes_its_dummy_uprobes_when_done() -> None:
    """pyctl/bpf/warmup.py: the perf uprobes it keeps the kernel's
    registration warm with are gone once the run's probes are in."""
    before = _fds()
    warmup.start(str(MAIN_OBJ))
    w = warmup._current
    assert w is not None
    while not w.fds and w.thread.is_alive():  # its first registration
        w._done.wait(0.001)
    assert w.fds and _fds() > before
    warmup.done(wait=True)
    assert _fds() == before and not w.thread.is_alive()


def test_gpufault_no_early_load_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFAULT_NO_EARLY_LOAD", "1")
    main_object.start_early()
    assert main_object._early is None


def test_a_trace_loads_a_one_page_stack_ring_and_an_inject_sized_one_serves_it() -> None:
    """A trace's specs never fire, so its object's ustacks ring is one page;
    the inject-sized object (`gpufault serve` preloads that one) serves a
    trace too, a trace-sized one never serves an inject (its copies would
    find no room), and an inject run keeps the full ring."""
    trace, inject = main_object.default_settings("trace"), main_object.default_settings()
    assert trace.ustacks_ring_bytes == main_object.USTACKS_RING_UNUSED
    assert inject.ustacks_ring_bytes == main_object.USTACKS_RING_BYTES
    main_object.start_early("trace")
    obj = main_object.take_early(trace)
    assert obj is not None
    try:
        assert obj.max_entries(Main.USTACKS) == main_object.USTACKS_RING_UNUSED
    finally:
        obj.close()
    main_object.start_early("inject")
    obj = main_object.take_early(trace)
    assert obj is not None  # the larger ring does for a trace
    try:
        assert obj.max_entries(Main.USTACKS) == main_object.USTACKS_RING_BYTES
    finally:
        obj.close()
    before = _fds()
    main_object.start_early("trace")
    assert main_object.take_early(inject) is None
    assert _fds() == before
    # The ring is the only thing that may differ: any other setting must match.
    assert not trace.served_by(dataclasses.replace(inject, ring_bytes=16 << 20))
