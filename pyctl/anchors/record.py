"""Decoded anchor records: fault-ID text, BDF text, register dictionaries."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pyctl.anchors import uapi

# 16 hex digits since 2026-12 (a host part, then the random half that the
# module carries: pyctl/evidence/hostid.py), 8 before it and in the
# module's own records.
_FAULT_ID = re.compile(r"^([0-9a-f]{16}|[0-9a-f]{8})-([0-9]+)$")


def fault_id_text(run_id: int, fault_seq: int) -> str:
    """The gpufault fault ID: "1a2b3c4d-7", or "kmod-7" for the module's own."""
    if run_id == 0:
        return f"kmod-{fault_seq}"
    return f"{run_id:08x}-{fault_seq}"


def parse_fault_id(text: str) -> tuple[int, int]:
    """(run_id, fault_seq) from "5e6f7a8b1a2b3c4d-7" or "1a2b3c4d-7";
    ValueError says what is expected."""
    m = _FAULT_ID.match(text)
    if not m or int(m.group(1)[-8:], 16) == 0 or int(m.group(2)) == 0:
        raise ValueError(
            f"fault ID {text!r}: expected 16 (or 8) hex digits, a dash and a "
            "sequence number >= 1, e.g. 5e6f7a8b1a2b3c4d-7"
        )
    seq = int(m.group(2))
    if seq >= 1 << 64:
        raise ValueError(f"fault ID {text!r}: sequence number does not fit in 64 bits")
    return int(m.group(1), 16), seq


def bdf_text(domain: int, bus: int, devfn: int) -> str:
    return f"{domain:04x}:{bus:02x}:{devfn >> 3:02x}.{devfn & 7}"


def parse_bdf(text: str) -> tuple[int, int, int]:
    """(domain, bus, devfn) from "[dddd:]bb:dd.f"."""
    m = re.match(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$", text)
    if not m or int(m.group(3), 16) > 0x1F:
        raise ValueError(f"PCI address {text!r}: expected [dddd:]bb:dd.f, e.g. 0000:01:00.0")
    dom = int(m.group(1), 16) if m.group(1) else 0
    return dom, int(m.group(2), 16), int(m.group(3), 16) << 3 | int(m.group(4))


@dataclass
class AnchorRecord:
    """One record from /dev/gpufa, decoded."""

    kind: str
    fault_id: str
    run_id: int
    fault_seq: int
    from_context: bool
    rec_seq: int
    mono_ns: int
    wall_ns: int
    bdf: str
    vendor: int
    device: int
    code: int
    pid: int
    ctx_pid: int
    comm: str
    config_ok: bool
    config: bytes
    devsta: int | None
    aer_pos: int
    aer: dict[str, int] | None
    # BAR0 offset -> value, None where the module could not read it.
    bar0: dict[int, int | None] = field(default_factory=dict)

    @classmethod
    def from_c(cls, rec: uapi.Record) -> AnchorRecord:
        if rec.version != uapi.ABI_VERSION or rec.size != uapi.RECORD_SIZE:
            raise ValueError(
                f"record version {rec.version} size {rec.size}: this client reads version "
                f"{uapi.ABI_VERSION} size {uapi.RECORD_SIZE}; rebuild gpufa.ko and gpufault "
                "from the same tree"
            )
        try:
            kind = uapi.Anchor(rec.kind).name.lower()
        except ValueError:
            kind = f"unknown-{rec.kind}"
        bar0 = {}
        for i in range(min(rec.bar0_nr, uapi.MAX_BAR0)):
            ok = rec.bar0_ok >> i & 1
            bar0[rec.bar0_off[i]] = rec.bar0_val[i] if ok else None
        aer = None
        if rec.flags & uapi.REC_AER_CAP:
            aer = dict(zip(uapi.AER_NAMES, rec.aer, strict=True))
        return cls(
            kind=kind,
            fault_id=fault_id_text(rec.run_id, rec.fault_seq),
            run_id=rec.run_id,
            fault_seq=rec.fault_seq,
            from_context=bool(rec.flags & uapi.REC_CTX),
            rec_seq=rec.rec_seq,
            mono_ns=rec.mono_ns,
            wall_ns=rec.wall_ns,
            bdf=bdf_text(rec.domain, rec.bus, rec.devfn),
            vendor=rec.vendor,
            device=rec.device,
            code=rec.code,
            pid=rec.pid,
            ctx_pid=rec.ctx_pid,
            comm=rec.comm.decode(errors="replace"),
            config_ok=bool(rec.flags & uapi.REC_CFG_OK),
            config=bytes(rec.config),
            devsta=rec.devsta if rec.flags & uapi.REC_PCIE else None,
            aer_pos=rec.aer_pos,
            aer=aer,
            bar0=bar0,
        )


def decode(buf: bytes) -> list[AnchorRecord]:
    """Records from a read() buffer; its length must be a whole number of records."""
    if len(buf) % uapi.RECORD_SIZE:
        raise ValueError(f"{len(buf)} bytes is not a multiple of {uapi.RECORD_SIZE}")
    return [
        AnchorRecord.from_c(uapi.Record.from_buffer_copy(buf, off))
        for off in range(0, len(buf), uapi.RECORD_SIZE)
    ]
