"""Decoding /dev/gpufa records and the fault-ID / PCI-address text forms."""

from __future__ import annotations

import ctypes

import pytest

from pyctl.anchors import uapi
from pyctl.anchors.record import (
    bdf_text,
    decode,
    fault_id_text,
    parse_bdf,
    parse_fault_id,
)
from pyctl.anchors.synth import make_record


def test_decode_fields() -> None:
    (rec,) = decode(bytes(make_record()))
    assert rec.kind == "reset_end"
    assert rec.fault_id == "1a2b3c4d-7"
    assert rec.from_context and rec.config_ok
    assert rec.bdf == "0000:01:01.2"
    assert (rec.vendor, rec.device, rec.code, rec.ctx_pid) == (0x1234, 0x11E8, -5, 4242)
    assert rec.comm == "python3"
    # The unread offset is None, not the all-ones marker value.
    assert rec.bar0 == {0x0: 0x010000ED, 0x100000: None}
    assert rec.config == bytes(range(256))
    assert rec.aer is None and rec.devsta is None


def test_decode_aer_and_module_id() -> None:
    r = make_record(run_id=0, flags=uapi.REC_AER_CAP | uapi.REC_PCIE, devsta=0x10)
    r.aer[uapi.AER_NAMES.index("uncor_status")] = 0x20
    (rec,) = decode(bytes(r))
    assert rec.fault_id == "kmod-7" and not rec.from_context
    assert rec.aer is not None and rec.aer["uncor_status"] == 0x20
    assert rec.devsta == 0x10


def test_decode_many_back_to_back() -> None:
    buf = b"".join(bytes(make_record(rec_seq=i, kind=k)) for i, k in enumerate(uapi.Anchor, 1))
    recs = decode(buf)
    assert [r.rec_seq for r in recs] == list(range(1, len(uapi.Anchor) + 1))
    assert {r.kind for r in recs} == {a.name.lower() for a in uapi.Anchor}


def test_decode_refuses_partial_buffer() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        decode(bytes(make_record())[:-1])


def test_decode_refuses_other_abi() -> None:
    with pytest.raises(ValueError, match="rebuild gpufa.ko"):
        decode(bytes(make_record(version=uapi.ABI_VERSION + 1)))
    with pytest.raises(ValueError, match="rebuild gpufa.ko"):
        decode(bytes(make_record(size=512)))


def test_unknown_kind_is_kept() -> None:
    (rec,) = decode(bytes(make_record(kind=99)))
    assert rec.kind == "unknown-99"


@pytest.mark.parametrize(
    ("run_id", "seq", "text"),
    [(0x1A2B3C4D, 7, "1a2b3c4d-7"), (1, 1, "00000001-1"), (0, 12, "kmod-12")],
)
def test_fault_id_text(run_id: int, seq: int, text: str) -> None:
    assert fault_id_text(run_id, seq) == text
    if run_id:
        assert parse_fault_id(text) == (run_id, seq)


def test_parse_fault_id_with_host_part() -> None:
    assert parse_fault_id("5e6f7a8b1a2b3c4d-7") == (0x5E6F7A8B1A2B3C4D, 7)


@pytest.mark.parametrize(
    "bad", ["", "kmod-3", "1a2b3c4d", "1a2b3c4d-0", "00000000-5", "1A2B3C4D-1", "1a2b3c4-1",
            "1a2b3c4d-x", f"1a2b3c4d-{1 << 64}", "5e6f7a8b00000000-1", "5e6f7a8b1a2b-1",
            "5e6f7a8b1a2b3c4d5-1"],
)  # fmt: skip
def test_parse_fault_id_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="fault ID"):
        parse_fault_id(bad)


@pytest.mark.parametrize(
    ("text", "want"),
    [("0000:01:01.0", (0, 1, 8)), ("01:00.7", (0, 1, 7)), ("10000:ff:1f.7", (0x10000, 255, 255))],
)
def test_parse_bdf(text: str, want: tuple[int, int, int]) -> None:
    assert parse_bdf(text) == want
    assert parse_bdf(bdf_text(*want)) == want


@pytest.mark.parametrize("bad", ["", "1:2", "0000:01:20.0", "0000:01:00.8", "zz:00.0"])
def test_parse_bdf_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="PCI address"):
        parse_bdf(bad)


def test_ctypes_record_has_no_hidden_padding() -> None:
    # Sum of field sizes == struct size: nothing the C side could lay out
    # differently.
    total = sum(ctypes.sizeof(t) for _, t in uapi.Record._fields_)
    assert total == uapi.RECORD_SIZE
