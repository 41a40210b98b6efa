"""Python mirror of kmod/uapi/gpufa.h: the /dev/gpufa record and ioctls.

Every size and offset here is checked against the C header by
tests/test_anchors_uapi.py, which compiles a program that prints them."""

from __future__ import annotations

import ctypes
import enum

ABI_VERSION = 1
CFG_SIZE = 256
MAX_BAR0 = 16
AER_REGS = 10
COMM_LEN = 16
BAR0_UNREAD = 0xFFFFFFFF

REC_CTX = 1 << 0
REC_CFG_OK = 1 << 1
REC_AER_CAP = 1 << 2
REC_PCIE = 1 << 3

FIRE_ANY = 1

AER_NAMES = (
    "uncor_status",
    "uncor_mask",
    "uncor_sever",
    "cor_status",
    "cor_mask",
    "cap_ctrl",
    "header_log0",
    "header_log1",
    "header_log2",
    "header_log3",
)


class Anchor(enum.IntEnum):
    RESET_BEGIN = 1
    RESET_END = 2
    GONE = 3
    AER = 4
    DRIVER = 5
    MANUAL = 6


class Record(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint16),
        ("size", ctypes.c_uint16),
        ("kind", ctypes.c_uint32),
        ("fault_seq", ctypes.c_uint64),
        ("run_id", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("rec_seq", ctypes.c_uint64),
        ("mono_ns", ctypes.c_uint64),
        ("wall_ns", ctypes.c_uint64),
        ("domain", ctypes.c_uint32),
        ("bus", ctypes.c_uint8),
        ("devfn", ctypes.c_uint8),
        ("vendor", ctypes.c_uint16),
        ("device", ctypes.c_uint16),
        ("devsta", ctypes.c_uint16),
        ("code", ctypes.c_int32),
        ("pid", ctypes.c_uint32),
        ("ctx_pid", ctypes.c_uint32),
        ("comm", ctypes.c_char * COMM_LEN),
        ("aer_pos", ctypes.c_uint32),
        ("aer", ctypes.c_uint32 * AER_REGS),
        ("bar0_nr", ctypes.c_uint32),
        ("bar0_ok", ctypes.c_uint32),
        ("bar0_off", ctypes.c_uint32 * MAX_BAR0),
        ("bar0_val", ctypes.c_uint32 * MAX_BAR0),
        ("reserved", ctypes.c_uint32),
        ("config", ctypes.c_uint8 * CFG_SIZE),
    ]


class Ctx(ctypes.Structure):
    _fields_ = [
        ("fault_seq", ctypes.c_uint64),
        ("run_id", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
    ]


class Fire(ctypes.Structure):
    _fields_ = [
        ("domain", ctypes.c_uint32),
        ("bus", ctypes.c_uint8),
        ("devfn", ctypes.c_uint8),
        ("flags", ctypes.c_uint16),
        ("code", ctypes.c_int32),
        ("pad", ctypes.c_uint32),
    ]


class Stats(ctypes.Structure):
    _fields_ = [
        ("records", ctypes.c_uint64),
        ("overflow", ctypes.c_uint64),
        ("nomem", ctypes.c_uint64),
        ("rp_missed", ctypes.c_uint64),
        ("queued", ctypes.c_uint32),
        ("capacity", ctypes.c_uint32),
        ("devices", ctypes.c_uint32),
        ("gone", ctypes.c_uint32),
        ("kprobes", ctypes.c_uint32),
        ("aer_hooked", ctypes.c_uint32),
    ]


RECORD_SIZE = ctypes.sizeof(Record)

# asm-generic/ioctl.h encoding (x86, arm64, riscv): dir << 30 | size << 16 | type << 8 | nr.
_IOC_WRITE = 1
_IOC_READ = 2


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ord("G") << 8) | nr


IOC_SET_CTX = _ioc(_IOC_WRITE, 1, ctypes.sizeof(Ctx))
IOC_CLEAR_CTX = _ioc(0, 2, 0)
IOC_FIRE = _ioc(_IOC_WRITE, 3, ctypes.sizeof(Fire))
IOC_STATS = _ioc(_IOC_READ, 4, ctypes.sizeof(Stats))
IOC_RESET = _ioc(_IOC_WRITE, 5, ctypes.sizeof(Fire))
