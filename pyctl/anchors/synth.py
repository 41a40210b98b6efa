"""Build records the way gpufa.ko writes them, for tests and demos that have
no module loaded (the edu test device, BAR0 0x0 read, a full config space)."""

from __future__ import annotations

from pyctl.anchors import uapi


def make_record(**kw: object) -> uapi.Record:
    """A record as the module would write it (edu device, BAR0 0x0 read)."""
    r = uapi.Record()
    r.version, r.size, r.kind = uapi.ABI_VERSION, uapi.RECORD_SIZE, uapi.Anchor.RESET_END
    r.fault_seq, r.run_id, r.flags = 7, 0x1A2B3C4D, uapi.REC_CTX | uapi.REC_CFG_OK
    r.domain, r.bus, r.devfn = 0, 1, (1 << 3) | 2
    r.vendor, r.device, r.code, r.pid, r.ctx_pid = 0x1234, 0x11E8, -5, 100, 4242
    r.comm = b"python3"
    r.bar0_nr, r.bar0_ok = 2, 0b01
    r.bar0_off[0], r.bar0_val[0] = 0x0, 0x010000ED
    r.bar0_off[1], r.bar0_val[1] = 0x100000, uapi.BAR0_UNREAD
    for i in range(uapi.CFG_SIZE):
        r.config[i] = i
    for k, v in kw.items():
        setattr(r, k, v)
    return r
