"""Python mirrors of bpf/gpufault.h. tests/test_abi.py compiles a C program
against the header and checks every size and field offset here, and every
enum value and #define of the header against the constants here and in
pyctl/copilot/model.py."""

from __future__ import annotations

import ctypes as C

ABI_VERSION = 3
MAX_SPECS = 64
NARGS = 6
NREGS = 21
MAX_STACK = 32
COMM_LEN = 16
USTACK_PAGE = 4096  # the BPF side copies the user stack page by page
USTACK_PAGES = 8  # at most 32 KiB per fire

# x86-64 struct pt_regs order (what BPF copies into regs[]).
REG_NAMES = (
    "r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10", "r9", "r8",
    "ax", "cx", "dx", "si", "di", "orig_ax", "ip", "cs", "flags", "sp", "ss",
)  # fmt: skip

ACT_OBSERVE, ACT_FAIL, ACT_SIGNAL, ACT_CORRUPT, ACT_STALL = 0, 1, 2, 3, 4
ACTIONS = {"observe": 0, "fail": 1, "signal": 2, "corrupt": 3, "stall": 4}
ACTION_NAMES = {v: k for k, v in ACTIONS.items()}

MECH_BPF, MECH_REGS, MECH_COPILOT, MECH_SIGNAL = 0, 1, 2, 3
MECH_NAMES = {0: "bpf", 1: "regs", 2: "copilot", 3: "signal"}

F_ENABLED = 1 << 0
F_STICKY = 1 << 1
F_AFTER = 1 << 2
F_TRACE = 1 << 3
F_CAP_STACK = 1 << 5
F_REGS = 1 << 6
F_COPILOT = 1 << 7
F_RETPROBE = 1 << 8
F_CAP_USTACK = 1 << 9  # copy the top of the user stack at a fire
F_SIGNAL = 1 << 10  # fail skip carried out by the in-target helper (pyctl/fastpath)

PRED_OPS = {"==": 1, "!=": 2, "<": 3, ">": 4, "<=": 5, ">=": 6, "&": 7}
CORRUPT_OPS = {"zero": 0, "xor": 1, "set": 2}

# enum gf_rec_kind: struct gf_hdr.kind of every ring record.
EV_CALL, EV_ENTRY, EV_FOLLOW = 1, 2, 3  # "events" ring: struct gf_call_event
REC_FIRE, REC_PROC = 4, 5  # "fires" ring: struct gf_fire_event, struct gf_proc_event
REC_USTACK = 6  # "ustacks" ring: struct gf_ustack_event, then the stack copy
PROC_SIGNAL, PROC_EXIT = 1, 2

STAT_NAMES = (
    "events_lost",
    "fires_lost",
    "signal_err",
    "pending_err",
    "inflight_err",
    "corrupt_err",
    "fires_skipped",
)
# The same array's diagnosis of failed events reservations (indexes follow
# STAT_NAMES): why each was refused, and the most bytes unread seen at one.
LOSS_CAUSE_NAMES = ("lost_full", "lost_room", "lost_backlog_max")
# Then: stack copies that found the ustacks ring full (the fire happened).
USTACK_STAT_NAMES = ("ustacks_lost",)
STAT_MAX = 11


def cookie(spec: int, func: int) -> int:
    return (spec << 32) | (func & 0xFFFFFFFF)


class Spec(C.Structure):
    _fields_ = [
        ("action", C.c_uint32),
        ("flags", C.c_uint32),
        ("retval", C.c_int64),
        ("tgid", C.c_uint32),
        ("tid", C.c_uint32),
        ("nth", C.c_uint64),
        ("every", C.c_uint64),
        ("after", C.c_uint64),
        ("max_fires", C.c_uint64),
        ("prob_ppm", C.c_uint32),
        ("signo", C.c_uint32),
        ("window_start_ns", C.c_uint64),
        ("deadline_ns", C.c_uint64),
        ("pred_arg", C.c_uint32),
        ("pred_op", C.c_uint32),
        ("pred_val", C.c_uint64),
        ("corrupt_arg", C.c_uint32),
        ("corrupt_op", C.c_uint32),
        ("corrupt_off", C.c_uint32),
        ("corrupt_len", C.c_uint32),
        ("corrupt_mask", C.c_uint64),
        ("stall_ns", C.c_uint64),
        ("caller_lo", C.c_uint64),
        ("caller_hi", C.c_uint64),
    ]


class Counters(C.Structure):
    _fields_ = [
        ("calls", C.c_uint64),
        ("fires", C.c_uint64),
        ("sticky", C.c_uint64),
        ("expired", C.c_uint64),
    ]


class Hdr(C.Structure):
    """struct gf_hdr: the first member of every ring record."""

    _fields_ = [("kind", C.c_uint32), ("size", C.c_uint32)]


# struct gf_call_event, field by field: the one definition of the call
# record on the Python side. CallEvent, CALL_RECORD_FMT, CALL_IX (the
# tuple index of every field in a record read by RingReader.read_fixed)
# and the calls table's columns and insert (pyctl/evidence/schema.py) are
# derived from it; tests/test_abi.py checks it against the C header.
CALL_FIELDS: tuple[tuple[str, type], ...] = (
    ("hdr", Hdr),
    ("ts_ns", C.c_uint64),
    ("latency_ns", C.c_uint64),
    ("cookie", C.c_uint64),
    ("call_seq", C.c_uint64),
    ("fault_seq", C.c_uint64),
    ("args", C.c_uint64 * NARGS),
    ("ret", C.c_int64),
    ("pid", C.c_uint32),
    ("tid", C.c_uint32),
)


class CallEvent(C.Structure):
    _fields_ = list(CALL_FIELDS)


# 64-bit fields are read signed: SQLite integers are signed 64-bit.
_FMT_OF: dict[type, str] = {C.c_uint64: "q", C.c_int64: "q", C.c_uint32: "I", C.c_int32: "i"}


def _flat(name: str, ctype: type) -> list[tuple[str, str]]:
    """(name, struct code) of every scalar in a field: a nested struct's
    members by their own names, an array's items as name1..nameN (args ->
    arg1..arg6, the calls table's column names)."""
    if isinstance(ctype, type) and issubclass(ctype, C.Structure):
        return [x for f in ctype._fields_ for x in _flat(f[0], f[1])]
    if isinstance(ctype, type) and issubclass(ctype, C.Array):
        item = name[:-1] if name.endswith("s") else name
        code = _FMT_OF[ctype._type_]  # type: ignore[index]
        n: int = ctype._length_  # type: ignore[assignment]
        return [(f"{item}{i + 1}", code) for i in range(n)]
    return [(name, _FMT_OF[ctype])]


# The 8-byte ring header (len | busy/discard flags, page offset) the kernel
# puts before every record, then the record's scalars in order.
CALL_SCALARS: tuple[str, ...] = ("ring_len", "ring_pgoff") + tuple(
    n for f in CALL_FIELDS for n, _ in _flat(*f)
)
# struct.Struct format of one ring record holding a CallEvent, native-endian.
CALL_RECORD_FMT = "=II" + "".join(c for f in CALL_FIELDS for _, c in _flat(*f))
CALL_IX: dict[str, int] = {n: i for i, n in enumerate(CALL_SCALARS)}


def s64(v: int) -> int:
    """A u64 as SQLite stores it (two's complement); u64() undoes it."""
    return v - (1 << 64) if v >= 1 << 63 else v


def u64(v: int) -> int:
    return v & ((1 << 64) - 1)


class FireEvent(C.Structure):
    _fields_ = [
        ("hdr", Hdr),
        ("fault_seq", C.c_uint64),
        ("ts_ns", C.c_uint64),
        ("cookie", C.c_uint64),
        ("call_seq", C.c_uint64),
        ("pid", C.c_uint32),
        ("tid", C.c_uint32),
        ("action", C.c_uint32),
        ("mech", C.c_uint32),
        ("retval", C.c_int64),
        ("flags", C.c_uint32),
        ("stack_bytes", C.c_int32),
        ("regs", C.c_uint64 * NREGS),
        ("comm", C.c_char * COMM_LEN),
        ("caller", C.c_uint64),
        ("stack", C.c_uint64 * MAX_STACK),
    ]


class ProcEvent(C.Structure):
    _fields_ = [
        ("hdr", Hdr),
        ("ts_ns", C.c_uint64),
        ("pid", C.c_uint32),
        ("tid", C.c_uint32),
        ("kind", C.c_uint32),
        ("signo", C.c_int32),
        ("code", C.c_int32),
        ("pad", C.c_uint32),
        ("comm", C.c_char * COMM_LEN),
    ]


class UstackEvent(C.Structure):
    """struct gf_ustack_event: `len` bytes of stack copy follow it."""

    _fields_ = [
        ("hdr", Hdr),
        ("fault_seq", C.c_uint64),
        ("base", C.c_uint64),
        ("len", C.c_uint32),
        ("got", C.c_int32),
    ]


def decode_ustack(data: bytes) -> tuple[UstackEvent, bytes]:
    """One record of the ustacks ring: the header and the bytes copied
    (got of them, from base up); a record of another layout is refused."""
    n = C.sizeof(UstackEvent)
    if len(data) < n:
        raise RecordError(f"ustacks ring record of {len(data)} bytes: shorter than its header")
    ev = UstackEvent.from_buffer_copy(data[:n])
    if (
        ev.hdr.kind != REC_USTACK
        or ev.hdr.size != n + ev.len
        or len(data) < ev.hdr.size
        or ev.len > USTACK_PAGES * USTACK_PAGE
    ):
        raise RecordError(
            f"ustacks ring record kind {ev.hdr.kind} size {ev.hdr.size} ({len(data)} bytes) is "
            "not this controller's: rebuild pyctl/data/gpufault.bpf.o (make build)"
        )
    got = max(0, min(ev.got, ev.len))
    return ev, bytes(data[n : n + got])


class Pending(C.Structure):
    _fields_ = [
        ("fault_seq", C.c_uint64),
        ("regs", C.c_uint64 * NREGS),
        ("retval", C.c_int64),
        ("stall_ns", C.c_uint64),
        ("deadline_ns", C.c_uint64),
        ("action", C.c_uint32),
        ("flags", C.c_uint32),
        ("corrupt_addr", C.c_uint64),
        ("corrupt_mask", C.c_uint64),
        ("corrupt_op", C.c_uint32),
        ("corrupt_len", C.c_uint32),
    ]


class Inflight(C.Structure):
    _fields_ = [
        ("ts_ns", C.c_uint64),
        ("call_seq", C.c_uint64),
        ("fault_seq", C.c_uint64),
        ("args", C.c_uint64 * NARGS),
        ("fired", C.c_uint32),
        ("pad", C.c_uint32),
    ]


class RecordError(Exception):
    """A ring record this controller cannot read: pyctl/data/gpufault.bpf.o
    was built from another bpf/gpufault.h (run make build)."""


# The fires ring's record kinds: the one place a record is told apart.
FIRES_RECORDS: dict[int, type[C.Structure]] = {REC_FIRE: FireEvent, REC_PROC: ProcEvent}


def decode_fires(data: bytes) -> FireEvent | ProcEvent:
    """One record of the fires ring, by its header's kind; its size must be
    the mirror's (a record of another layout is refused, not misread)."""
    if len(data) < C.sizeof(Hdr):
        raise RecordError(f"ring record of {len(data)} bytes: shorter than its header")
    hdr = Hdr.from_buffer_copy(data[: C.sizeof(Hdr)])
    cls = FIRES_RECORDS.get(hdr.kind)
    if cls is None or hdr.size != C.sizeof(cls) or len(data) < hdr.size:
        raise RecordError(
            f"fires ring record kind {hdr.kind} size {hdr.size} ({len(data)} bytes) is not "
            "this controller's: rebuild pyctl/data/gpufault.bpf.o (make build)"
        )
    return cls.from_buffer_copy(data[: hdr.size])  # type: ignore[return-value]


# name in the C header -> mirror, for the ABI test.
MIRRORS: dict[str, type[C.Structure]] = {
    "gf_hdr": Hdr,
    "gf_spec": Spec,
    "gf_counters": Counters,
    "gf_call_event": CallEvent,
    "gf_fire_event": FireEvent,
    "gf_proc_event": ProcEvent,
    "gf_ustack_event": UstackEvent,
    "gf_pending": Pending,
    "gf_inflight": Inflight,
}
