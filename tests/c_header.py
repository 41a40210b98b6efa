"""Values a C header gives, compiled with the host's cc: what the ctypes
mirrors of bpf/*.h are checked against (sizes, field offsets, constants)."""

from __future__ import annotations

import ctypes as C
import subprocess
from collections.abc import Mapping
from pathlib import Path

BPF_DIR = Path(__file__).resolve().parent.parent / "bpf"
_PRELUDE = ["#include <stdio.h>", "#include <stddef.h>", "#include <linux/types.h>"]


def _run(tmp_path: Path, header: str, body: list[str], name: str) -> list[str]:
    src = tmp_path / f"{name}.c"
    src.write_text(
        "\n".join([*_PRELUDE, f'#include "{header}"', "int main(void) {", *body, "return 0; }"])
    )
    exe = tmp_path / name
    subprocess.run(["cc", "-I", str(BPF_DIR), "-o", str(exe), str(src)], check=True)
    return subprocess.run(
        [str(exe)], capture_output=True, text=True, check=True
    ).stdout.splitlines()


def layout(tmp_path: Path, header: str, mirrors: Mapping[str, type[C.Structure]]) -> dict[str, int]:
    """{"struct": sizeof, "struct.field": offsetof} for every mirrored struct."""
    body = []
    for cname, py in mirrors.items():
        body.append(f'printf("{cname} %zu\\n", sizeof(struct {cname}));')
        for f in py._fields_:
            body.append(f'printf("{cname}.{f[0]} %zu\\n", offsetof(struct {cname}, {f[0]}));')
    return {k: int(v) for k, v in (ln.split() for ln in _run(tmp_path, header, body, "layout"))}


def values(tmp_path: Path, header: str, exprs: list[str]) -> dict[str, int]:
    """Each C expression's value, as the compiler reads it."""
    body = [f'printf("%s %lld\\n", "{e}", (long long)({e}));' for e in exprs]
    return {
        k: int(v) for k, v in (ln.rsplit(" ", 1) for ln in _run(tmp_path, header, body, "values"))
    }


def assert_mirrors(c: Mapping[str, int], mirrors: Mapping[str, type[C.Structure]]) -> None:
    for cname, py in mirrors.items():
        assert C.sizeof(py) == c[cname], cname
        for f in py._fields_:
            assert getattr(py, f[0]).offset == c[f"{cname}.{f[0]}"], f"{cname}.{f[0]}"
