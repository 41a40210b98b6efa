"""Our uprobe programs must not get a per-CPU private stack.

Kernels since 6.13 give a BPF program whose stack reaches 64 bytes a
private stack per CPU. Uprobe programs run preemptibly, so two threads on
one CPU can be inside the program at once and share that stack: the
kernel oopses (seen on Debian's 7.2 under qemu with 8 threads firing). The
engine keeps its state in task storage instead; this test loads every
uprobe program and inspects the JIT image's prologue (x86-64: the private
frame pointer is r9, loaded with `movabs $off,%r9; add %gs:...,%r9`)."""

from __future__ import annotations

import ctypes as C
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pyctl.bpf.libbpf import BpfError, Object, lib
from pyctl.capabilities import (
    MAIN_OBJ,
    UPROBE_PROGRAMS,
    engine_programs,
    regs_writable,
    user_writable,
)

pytestmark = [pytest.mark.root]

PROGS = list(UPROBE_PROGRAMS)
PRIVATE_STACK_PROLOGUE = bytes.fromhex("65 4c 03 0c 25".replace(" ", ""))  # add %gs:X,%r9


def _prog_image(prog_fd: int, len_at: int, ptr_at: int) -> bytes:
    """One of a program's images from struct bpf_prog_info: its length is
    the u32 at len_at, the pointer to fill the u64 at ptr_at."""
    get = lib().bpf_obj_get_info_by_fd
    get.argtypes = [C.c_int, C.c_void_p, C.POINTER(C.c_uint32)]
    info = (C.c_uint8 * 512)()
    n = C.c_uint32(512)
    assert get(prog_fd, info, C.byref(n)) == 0
    size = int.from_bytes(bytes(info[len_at : len_at + 4]), "little")
    code = (C.c_uint8 * size)()
    info2 = (C.c_uint8 * 512)()
    info2[len_at : len_at + 4] = list(size.to_bytes(4, "little"))
    info2[ptr_at : ptr_at + 8] = list(C.addressof(code).to_bytes(8, "little"))
    n = C.c_uint32(512)
    assert get(prog_fd, info2, C.byref(n)) == 0
    return bytes(code)


def jit_image(prog_fd: int) -> bytes:
    return _prog_image(prog_fd, 16, 24)  # jited_prog_len, jited_prog_insns


@contextmanager
def only_loaded(prog: str) -> Iterator[int]:
    """The main object with only prog loaded; yields prog's fd."""
    obj = Object(MAIN_OBJ)
    try:
        for p in PROGS:
            obj.set_autoload(p, p == prog)
        try:
            obj.load()
        except BpfError as e:
            pytest.fail(f"{prog} failed to load: {e}")
        yield lib().bpf_program__fd(obj.program(prog))
    finally:
        obj.close()


def loadable() -> set[str]:
    """Every program some (regs, user-writes) combination this kernel allows
    would load."""
    combos = [(r, w) for r in (False, regs_writable()) for w in (False, user_writable())]
    return {p for r, w in combos for p in engine_programs(r, w)}


@pytest.mark.parametrize("prog", PROGS)
def test_no_private_stack(prog: str) -> None:
    if prog not in loadable():
        pytest.skip(f"{prog} does not load on this kernel")
    with only_loaded(prog) as fd:
        head = jit_image(fd)[:64]
    assert PRIVATE_STACK_PROLOGUE not in head, f"{prog} uses a per-CPU private stack"


def xlated_stack_bytes(prog_fd: int) -> int:
    """The deepest frame-pointer (r10) offset the verified program uses."""
    code = _prog_image(prog_fd, 20, 32)  # xlated_prog_len, xlated_prog_insns
    deepest = 0
    for i in range(0, len(code), 8):  # struct bpf_insn: code, dst:4|src:4, off s16, imm s32
        op, regs = code[i], code[i + 1]
        off = int.from_bytes(bytes(code[i + 2 : i + 4]), "little", signed=True)
        if op & 0x07 in (0x01, 0x02, 0x03) and 10 in (regs & 0x0F, regs >> 4) and off < 0:
            deepest = max(deepest, -off)  # LDX, ST, STX through r10
    return deepest


@pytest.mark.parametrize("prog", PROGS)
def test_stack_stays_below_the_private_stack_size(prog: str) -> None:
    """The same rule on every kernel, so this machine's CI catches what only
    a 7.x kernel would show: a loss diagnosis that also read the ring's
    pending_pos took gf_entry from 48 to 56 bytes, and on Debian's 7.2 it
    got a private stack (8 threads firing then corrupted fire records and
    oopsed the guest). 48 bytes did not; the kernel sizes the frame in 16s."""
    if prog not in loadable():
        pytest.skip(f"{prog} does not load on this kernel")
    with only_loaded(prog) as fd:
        depth = xlated_stack_bytes(fd)
    assert 0 < depth <= 48, f"{prog} uses {depth} bytes of stack"
