"""The Python mirrors of bpf/gpufault.h match the C layout (sizes and every
field offset), checked by compiling a C program against the header."""

from __future__ import annotations

import ctypes as C
import re
import shutil
from pathlib import Path

import c_header
import pytest

from pyctl.bpf import abi

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_mirrors_match_header(tmp_path: Path) -> None:
    c_header.assert_mirrors(c_header.layout(tmp_path, "gpufault.h", abi.MIRRORS), abi.MIRRORS)


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

    from pyctl.evidence import store

    sql = store._CALL_RECORD_SQL
    assert not re.search(r"\?\d", sql)
    assert sql.count("?") == len(
        struct.Struct(abi.CALL_RECORD_FMT).unpack(bytes(struct.calcsize(abi.CALL_RECORD_FMT)))
    )


# ---- every struct, enum and #define of the header, against abi.py ------------

HEADER = (REPO / "bpf" / "gpufault.h").read_text()


def header_structs() -> dict[str, list[str]]:
    """Member names of every struct defined in the header, in order."""
    out = {}
    for m in re.finditer(r"^struct (\w+) \{\n(.*?)^\};", HEADER, re.M | re.S):
        body = re.sub(r"/\*.*?\*/", "", m.group(2), flags=re.S)
        out[m.group(1)] = re.findall(r"(\w+)(?:\[[^\]]+\])?;", body)
    return out


def header_constants() -> list[str]:
    """Every enum constant and every object-like #define (not the guard)."""
    names = []
    for m in re.finditer(r"^enum \w+ \{\n(.*?)^\};", HEADER, re.M | re.S):
        body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
        names += re.findall(r"^\s*(GF_\w+)\s*=", body, re.M)
    names += [n for n in re.findall(r"^#define (GF_\w+)\s+\S", HEADER, re.M)]
    return names


def python_value(name: str) -> int:
    """The Python side of a header constant: abi's attribute of the same
    name without GF_, or the table entry that stands for it."""
    short = name[3:]
    tables: dict[str, tuple[dict[str, int] | tuple[str, ...], str]] = {
        "PRED_": (abi.PRED_OPS, "op"),
        "CORRUPT_": (abi.CORRUPT_OPS, "op"),
        "STAT_": (abi.STAT_NAMES, "index"),
    }
    if hasattr(abi, short):
        return int(getattr(abi, short))
    if short == "PRED_NONE":
        return 0  # no predicate: the spec's pred_arg is 0, nothing to mirror
    ops = {"EQ": "==", "NE": "!=", "LT": "<", "GT": ">", "LE": "<=", "GE": ">=", "MASK": "&"}
    for prefix, (table, how) in tables.items():
        if short.startswith(prefix):
            key = short[len(prefix) :]
            if how == "index":
                every = abi.STAT_NAMES + abi.LOSS_CAUSE_NAMES + abi.USTACK_STAT_NAMES
                return every.index(key.lower())
            return table[ops.get(key, key.lower())]  # type: ignore[index]
    if short == "COMM_LEN":
        return abi.COMM_LEN
    raise AssertionError(f"{name}: no Python mirror in pyctl/bpf/abi.py")


def test_every_header_struct_is_mirrored_field_by_field() -> None:
    structs = header_structs()
    assert set(structs) == set(abi.MIRRORS)
    for cname, fields in structs.items():
        assert [f[0] for f in abi.MIRRORS[cname]._fields_] == fields, cname


def test_call_record_fields_are_the_headers() -> None:
    assert [n for n, _ in abi.CALL_FIELDS] == header_structs()["gf_call_event"]
    assert abi.CallEvent._fields_ == list(abi.CALL_FIELDS)
    assert abi.CALL_SCALARS[:4] == ("ring_len", "ring_pgoff", "kind", "size")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_every_header_constant_matches_python(tmp_path: Path) -> None:
    from pyctl.copilot import model

    names = header_constants()
    assert len(names) > 40, names
    c = c_header.values(tmp_path, "gpufault.h", names)
    for n in names:
        assert python_value(n) == c[n], n
    # The copilot keeps its own few (it must not import the engine's ABI).
    mirrored = [k for k in vars(model) if k.startswith("GF_")]
    assert mirrored
    for k in mirrored:
        assert getattr(model, k) == c[k], f"copilot/model.py {k}"


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_cookie_macros_match(tmp_path: Path) -> None:
    cases = [(0, 0), (3, 5), (63, 0xFFFFFFFF), (1, 1 << 31)]
    exprs = [f"GF_COOKIE({s}, {f}u)" for s, f in cases]
    exprs += [f"GF_COOKIE_SPEC(GF_COOKIE({s}, {f}u))" for s, f in cases]
    exprs += [f"GF_COOKIE_FUNC(GF_COOKIE({s}, {f}u))" for s, f in cases]
    c = c_header.values(tmp_path, "gpufault.h", exprs)
    for s, f in cases:
        ck = abi.cookie(s, f)
        assert abi.s64(ck) == c[f"GF_COOKIE({s}, {f}u)"]
        assert ck >> 32 == c[f"GF_COOKIE_SPEC(GF_COOKIE({s}, {f}u))"]
        assert ck & 0xFFFFFFFF == c[f"GF_COOKIE_FUNC(GF_COOKIE({s}, {f}u))"]


def test_fires_records_are_decoded_by_kind() -> None:
    fire = abi.FireEvent(hdr=abi.Hdr(abi.REC_FIRE, C.sizeof(abi.FireEvent)), fault_seq=7)
    proc = abi.ProcEvent(hdr=abi.Hdr(abi.REC_PROC, C.sizeof(abi.ProcEvent)), signo=11)
    got = abi.decode_fires(bytes(fire))
    assert isinstance(got, abi.FireEvent) and got.fault_seq == 7
    got = abi.decode_fires(bytes(proc) + bytes(8))  # the ring rounds up to 8
    assert isinstance(got, abi.ProcEvent) and got.signo == 11
    with pytest.raises(abi.RecordError, match="make build"):
        abi.decode_fires(bytes(abi.ProcEvent(hdr=abi.Hdr(abi.REC_PROC, 48))))
    with pytest.raises(abi.RecordError, match="make build"):
        abi.decode_fires(bytes(abi.Hdr(99, 8)))


def test_ustack_records_carry_their_copy() -> None:
    n = C.sizeof(abi.UstackEvent)
    ev = abi.UstackEvent(hdr=abi.Hdr(abi.REC_USTACK, n + 8192), fault_seq=3, base=0x7000,
                         len=8192, got=4096)  # fmt: skip
    data = bytes(ev) + b"\x01" * 4096 + b"\x02" * 4096
    got, copy = abi.decode_ustack(data + bytes(8))
    assert got.fault_seq == 3 and got.base == 0x7000 and copy == b"\x01" * 4096
    ev.got = -14  # no page read: no bytes
    assert abi.decode_ustack(bytes(ev) + bytes(8192))[1] == b""
    with pytest.raises(abi.RecordError, match="make build"):
        abi.decode_ustack(data[:-1])  # shorter than its size says
    ev.hdr.size = n + 4096  # a size that is not header + len
    with pytest.raises(abi.RecordError, match="make build"):
        abi.decode_ustack(bytes(ev) + bytes(8192))
