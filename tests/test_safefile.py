"""pyctl.safefile.read_checked: the one way a root tool reads a small file
it was pointed at (a token, a machine-id, a prompt set)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pyctl.safefile import SafeFileError, read_checked


def _why(path: Path, **kw: object) -> str:
    with pytest.raises(SafeFileError) as ei:
        read_checked(path, 64, **kw)  # type: ignore[arg-type]
    return ei.value.why


def test_reads_a_regular_file_within_the_limit(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"x" * 64)
    assert read_checked(p, 64) == b"x" * 64
    p.write_bytes(b"x" * 65)
    assert _why(p) == "size"


def test_refuses_what_the_name_must_not_be(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("secret")
    (tmp_path / "link").symlink_to(target)
    assert _why(tmp_path / "link") == "link"  # not followed
    assert _why(tmp_path / "missing") == "open"
    assert _why(tmp_path) == "type"
    os.mkfifo(tmp_path / "fifo")
    assert _why(tmp_path / "fifo") == "type"  # O_NONBLOCK: the open does not wait for a writer


@pytest.mark.root
def test_owner_and_mode_are_checked_on_the_descriptor(tmp_path: Path) -> None:
    p = tmp_path / "tok"
    p.write_text("t")
    os.chmod(p, 0o600)
    assert read_checked(p, 64, owner=0, private=True) == b"t"
    os.chmod(p, 0o640)
    assert _why(p, owner=0, private=True) == "mode"
    os.chmod(p, 0o600)
    os.chown(p, 65534, 65534)
    with pytest.raises(SafeFileError) as ei:
        read_checked(p, 64, owner=0)
    assert ei.value.why == "owner" and ei.value.detail == "65534"
