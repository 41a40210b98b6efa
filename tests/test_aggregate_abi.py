"""The Python mirrors of bpf/aggregate.h (pyctl/bpf/aggregate_abi.py) match
the C layout: sizes and every field offset, from a compiled C program."""

from __future__ import annotations

import shutil
from pathlib import Path

import c_header
import pytest

from pyctl.bpf import aggregate_abi as abi

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_mirrors_match_header(tmp_path: Path) -> None:
    c_header.assert_mirrors(c_header.layout(tmp_path, "aggregate.h", abi.MIRRORS), abi.MIRRORS)


def test_header_constants_match() -> None:
    text = (REPO / "bpf" / "aggregate.h").read_text()
    for name, val in [
        ("AGG_SLOTS", abi.SLOTS),
        ("AGG_DEPTH", abi.DEPTH),
        ("AGG_MISC_MAX", abi.MISC_MAX),
    ]:
        assert f"#define {name} {val}" in text, name
    assert f"AGG_ERR_NONZERO32 = {abi.ERR_NONZERO32}" in text
