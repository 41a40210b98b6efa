"""The Python mirrors of bpf/aggregate.h (pyctl/bpf/aggregate_abi.py) match
the C layout: sizes and every field offset, from a compiled C program."""

from __future__ import annotations

import ctypes as C
import shutil
import subprocess
from pathlib import Path

import pytest

from pyctl.bpf import aggregate_abi as abi

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_mirrors_match_header(tmp_path: Path) -> None:
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        "#include <linux/types.h>",
        '#include "aggregate.h"',
        "int main(void) {",
    ]
    for cname, py in abi.MIRRORS.items():
        lines.append(f'printf("{cname} %zu\\n", sizeof(struct {cname}));')
        for f in py._fields_:
            lines.append(f'printf("{cname}.{f[0]} %zu\\n", offsetof(struct {cname}, {f[0]}));')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-I", str(REPO / "bpf"), "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    c = {k: int(v) for k, v in (ln.split() for ln in out.splitlines())}
    for cname, py in abi.MIRRORS.items():
        assert C.sizeof(py) == c[cname], cname
        for f in py._fields_:
            assert getattr(py, f[0]).offset == c[f"{cname}.{f[0]}"], f"{cname}.{f[0]}"


def test_header_constants_match() -> None:
    text = (REPO / "bpf" / "aggregate.h").read_text()
    for name, val in [
        ("AGG_SLOTS", abi.SLOTS),
        ("AGG_DEPTH", abi.DEPTH),
        ("AGG_MISC_MAX", abi.MISC_MAX),
    ]:
        assert f"#define {name} {val}" in text, name
    assert f"AGG_ERR_NONZERO32 = {abi.ERR_NONZERO32}" in text
