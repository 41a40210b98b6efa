"""The engine's object loaded early (pyctl/bpf/main_object.py): the run
takes it only when its settings are the ones it was loaded with; any other
is closed, never leaked; and the early load can be turned off."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest

from pyctl.bpf import main_object
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


def test_gpufault_no_early_load_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFAULT_NO_EARLY_LOAD", "1")
    main_object.start_early()
    assert main_object._early is None
