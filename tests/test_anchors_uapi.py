"""pyctl/anchors/uapi.py mirrors kmod/uapi/gpufa.h: sizes, offsets, constants
and ioctl numbers, compared with what a C compiler says about the header."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pyctl.anchors import uapi

REPO = Path(__file__).resolve().parent.parent
HEADER = REPO / "kmod" / "uapi" / "gpufa.h"

STRUCTS = {
    "gpufa_record": uapi.Record,
    "gpufa_ctx": uapi.Ctx,
    "gpufa_fire": uapi.Fire,
    "gpufa_stats": uapi.Stats,
}
CONSTANTS = {
    "GPUFA_ABI_VERSION": uapi.ABI_VERSION,
    "GPUFA_CFG_SIZE": uapi.CFG_SIZE,
    "GPUFA_MAX_BAR0": uapi.MAX_BAR0,
    "GPUFA_AER_REGS": uapi.AER_REGS,
    "GPUFA_COMM_LEN": uapi.COMM_LEN,
    "GPUFA_BAR0_UNREAD": uapi.BAR0_UNREAD,
    "GPUFA_REC_CTX": uapi.REC_CTX,
    "GPUFA_REC_CFG_OK": uapi.REC_CFG_OK,
    "GPUFA_REC_AER_CAP": uapi.REC_AER_CAP,
    "GPUFA_REC_PCIE": uapi.REC_PCIE,
    "GPUFA_FIRE_ANY": uapi.FIRE_ANY,
    "GPUFA_IOC_SET_CTX": uapi.IOC_SET_CTX,
    "GPUFA_IOC_CLEAR_CTX": uapi.IOC_CLEAR_CTX,
    "GPUFA_IOC_FIRE": uapi.IOC_FIRE,
    "GPUFA_IOC_STATS": uapi.IOC_STATS,
    "GPUFA_IOC_RESET": uapi.IOC_RESET,
    **{f"GPUFA_ANCHOR_{a.name}": int(a) for a in uapi.Anchor},
}


def header_fields(struct: str) -> list[str]:
    """Field names of a struct in the header, in order (arrays included)."""
    text = HEADER.read_text()
    body = re.search(rf"struct {struct} {{(.*?)\n}};", text, re.S)
    assert body, f"struct {struct} not found in {HEADER}"
    code = re.sub(r"/\*.*?\*/", "", body.group(1), flags=re.S)
    return re.findall(r"(\w+)(?:\[[^\]]*\])?;", code)


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """name -> value printed by a C program compiled against the header."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (apt-get install gcc)")
    lines = ["#include <stdio.h>", "#include <stddef.h>", f'#include "{HEADER}"', "int main(void){"]
    for s in STRUCTS:
        lines.append(f'printf("sizeof.{s} %zu\\n", sizeof(struct {s}));')
        for f in header_fields(s):
            lines.append(f'printf("offsetof.{s}.{f} %zu\\n", offsetof(struct {s}, {f}));')
    for c in CONSTANTS:
        lines.append(f'printf("const.{c} %llu\\n", (unsigned long long)({c}));')
    lines.append("return 0;}")
    d = tmp_path_factory.mktemp("uapi")
    (d / "layout.c").write_text("\n".join(lines))
    subprocess.run([cc, "-Wall", "-Werror", "-o", str(d / "layout"), str(d / "layout.c")],
                   check=True)  # fmt: skip
    out = subprocess.run([str(d / "layout")], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (ln.split() for ln in out.splitlines())}


@pytest.mark.parametrize("name", list(STRUCTS))
def test_struct_size_and_fields(c_layout: dict[str, int], name: str) -> None:
    py = STRUCTS[name]
    assert ctypes.sizeof(py) == c_layout[f"sizeof.{name}"]
    assert [f[0] for f in py._fields_] == header_fields(name)
    for f in header_fields(name):
        assert getattr(py, f).offset == c_layout[f"offsetof.{name}.{f}"], f


@pytest.mark.parametrize("name", list(CONSTANTS))
def test_constant(c_layout: dict[str, int], name: str) -> None:
    assert CONSTANTS[name] == c_layout[f"const.{name}"]


def test_record_size_is_aligned() -> None:
    # Records are read back to back; a size that is not a multiple of 8
    # would misalign every second record's 64-bit fields.
    assert uapi.RECORD_SIZE % 8 == 0
    assert uapi.RECORD_SIZE == 528


def test_every_anchor_kind_mirrored() -> None:
    kinds = set(re.findall(r"GPUFA_ANCHOR_(\w+) = \d+", HEADER.read_text()))
    assert kinds == {a.name for a in uapi.Anchor}
