"""Shared fixtures and skip helpers. Tiers: unit (anyone), root (real BPF
on this kernel), vm (qemu/TCG). A skip always says why."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build"


def is_root() -> bool:
    return os.geteuid() == 0


requires_root = pytest.mark.skipif(not is_root(), reason="requires root (BPF, ptrace)")


@pytest.fixture
def tmp_db(tmp_path: Path) -> Path:
    return tmp_path / "gf.db"
