"""The Python mirrors of bpf/gpufault.h match the C layout (sizes and every
field offset), checked by compiling a C program against the header."""

from __future__ import annotations

import ctypes as C
import shutil
import subprocess
from pathlib import Path

import pytest

from pyctl.bpf import abi

REPO = Path(__file__).resolve().parent.parent


def c_layout(tmp_path: Path) -> dict[str, int]:
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        "#include <linux/types.h>",
        '#include "gpufault.h"',
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
    return {k: int(v) for k, v in (ln.split() for ln in out.splitlines())}


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_mirrors_match_header(tmp_path: Path) -> None:
    c = c_layout(tmp_path)
    for cname, py in abi.MIRRORS.items():
        assert C.sizeof(py) == c[cname], cname
        for f in py._fields_:
            assert getattr(py, f[0]).offset == c[f"{cname}.{f[0]}"], f"{cname}.{f[0]}"


def test_call_record_format_matches_event() -> None:
    import struct

    assert struct.calcsize(abi.CALL_RECORD_FMT) == 8 + C.sizeof(abi.CallEvent)


def test_header_constants_match() -> None:
    text = (REPO / "bpf" / "gpufault.h").read_text()
    for name, val in [
        ("GF_MAX_SPECS", abi.MAX_SPECS),
        ("GF_NARGS", abi.NARGS),
        ("GF_NREGS", abi.NREGS),
        ("GF_MAX_STACK", abi.MAX_STACK),
        ("GF_ABI_VERSION", abi.ABI_VERSION),
    ]:
        assert f"#define {name} {val}" in text, name


def test_call_record_sql_binds_plain_qmarks_only() -> None:
    # Numbered placeholders (?3) bound from a sequence cost a DeprecationWarning
    # per binding and row on Python 3.12 (10x slower ingest) and fail on 3.14.
    import re
    import struct

    from pyctl import store

    sql = store._CALL_RECORD_SQL
    assert not re.search(r"\?\d", sql)
    assert sql.count("?") == len(struct.Struct(abi.CALL_RECORD_FMT).unpack(
        bytes(struct.calcsize(abi.CALL_RECORD_FMT))))
